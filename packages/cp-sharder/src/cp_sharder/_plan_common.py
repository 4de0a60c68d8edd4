"""What both planners share: the plan's records and the padding of token tensors.

:mod:`cp_sharder.planning` (``[B, S]`` rows) and :mod:`cp_sharder.planning_thd` (packed THD
streams) both build a :class:`BatchPlan` and pad the same way; this module holds that, so the
two planners import it and not each other.

Dimension letters: B batch, S sequence (input), P padded sequence, W cp size, N packed
sequences.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cp_sharder.layouts import LayoutKind

__all__ = [
    "BatchPlan",
    "PlanOptions",
    "SequencePlan",
    "TrainContext",
    "continue_positions",
    "fill_value",
    "pad_tensor",
]

TrainContext = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanOptions:
    """What the planner needs to know about the sharder.

    Attributes:
        cp: W.
        padding_token_id: input id used to pad ``input_ids``.
        ignore_index: label value of padding.
        extra_seq_buffers: further token-aligned keys and their sequence dim.
        te: the model runs Transformer Engine attention (its THD kernels need 2W-divisible
            sequences).
    """

    cp: int
    padding_token_id: int = 0
    ignore_index: int = -100
    extra_seq_buffers: Mapping[str, int] | None = None
    te: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class SequencePlan:
    """How one global batch's sequence is padded and laid out, and its label count.

    What a shard layout keeps of the plan (no tensors of the batch itself).

    Attributes:
        kind: the token layout.
        original_seq_len: S ([B, S] batch) or T (packed batch).
        padded_seq_len: P.
        input_row_shape: (B, S) of a packed batch, else None.
        cu_seqlens_padded: [N+1] int64 padded packed boundaries, else None.
        num_label_tokens: labels != ignore_index in the batch.
    """

    kind: LayoutKind
    original_seq_len: int
    padded_seq_len: int
    input_row_shape: tuple[int, int] | None = None
    cu_seqlens_padded: Tensor | None = None
    num_label_tokens: int = 0


@dataclass(kw_only=True, slots=True)
class BatchPlan:
    """Everything derived from one batch before any collective.

    Attributes:
        tensors: padded global token tensors (sequence dim per ``seq_dims``).
        seq_dims: the sequence dim of each token tensor.
        passthrough: non-token keys handed to the model unchanged.
        sequence: the layout kind, lengths, packed boundaries and label count.
        doc_ids: [B or 1, P] int64 document id per position for the mask-based backend, or None
            (one document per row).
        key_valid: [B, P] bool, False on keys nobody may attend to, or None.
        segment_ids: [B or 1, P] int64 (CPU) varlen segment id per position: documents, and
            padding as segments of its own; None when the rows are not packed.
        right_padded: every padding token (attention_mask 0, trailing pad) sits after the
            row's last real token, so causal attention never reaches it.
        thd: the batch is packed THD.
        hook_context: the model hook's train_ctx, if any.
    """

    tensors: dict[str, Tensor]
    seq_dims: dict[str, int]
    passthrough: dict[str, Any]
    sequence: SequencePlan
    doc_ids: Tensor | None
    key_valid: Tensor | None
    segment_ids: Tensor | None
    right_padded: bool
    thd: bool
    hook_context: TrainContext | None


def pad_tensor(t: Tensor, dim: int, amount: int, value: float | bool) -> Tensor:
    """Right-pad ``t`` along ``dim`` by ``amount`` entries of ``value``."""
    if amount == 0:
        return t
    dim = dim % t.dim()
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, amount]
    if t.dtype == torch.bool:
        return F.pad(t.to(torch.uint8), pad, value=int(value)).to(torch.bool)
    return F.pad(t, pad, value=value)


def continue_positions(pos: Tensor, amount: int) -> Tensor:
    """Extend positions along the last dim so they keep counting from the last one."""
    if amount == 0:
        return pos
    step = torch.arange(1, amount + 1, dtype=pos.dtype, device=pos.device)
    return torch.cat([pos, pos[..., -1:] + step], dim=-1)


def fill_value(name: str, t: Tensor, options: PlanOptions) -> float | bool:
    """The value that pads token tensor ``name``: pad id, ignore_index, True or zero."""
    if name == "input_ids":
        return options.padding_token_id
    if name == "labels":
        return options.ignore_index
    if name == "padding_mask":
        return True
    return False if t.dtype == torch.bool else 0
