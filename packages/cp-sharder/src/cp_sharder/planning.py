"""Batch planning: validation, padding and document structure of one global batch (pure, no comms).

:func:`plan_batch` turns a global batch into a :class:`BatchPlan`: the padded token tensors,
the layout kind, and the document structure the attention backends need. It touches no process
group, so every rank computes the same plan from the same batch.

Dimension letters: B batch, S sequence (input), P padded sequence, W cp size, T packed tokens
(B*S), N packed sequences.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from cp_sharder import layouts
from cp_sharder._plan_common import (
    BatchPlan,
    PlanOptions,
    SequencePlan,
    TrainContext,
    continue_positions,
    fill_value,
    pad_tensor,
)
from cp_sharder.layouts import LayoutKind
from cp_sharder.planning_thd import plan_thd

__all__ = ["BatchPlan", "PlanOptions", "SequencePlan", "docs_from_positions", "plan_batch"]

# Keys the sharder reads and never forwards to the model.
SHARDER_KEYS = ("qkv_format", "seq_lens", "seq_lens_padded")
# Token-aligned keys the sharder knows: sequence dim (for [B, S] tensors) and pad value kind.
KNOWN_TOKEN_KEYS = (
    "input_ids",
    "inputs_embeds",
    "labels",
    "position_ids",
    "attention_mask",
    "padding_mask",
    "loss_mask",
)


def _suffix(flags: Tensor) -> Tensor:
    """[B, S] bool: True on the trailing run of True entries of each row."""
    return flags.flip(-1).to(torch.int64).cumprod(-1).flip(-1).bool()


def docs_from_positions(pos: Tensor, padding: Tensor | None = None) -> Tensor | None:
    """[B, P] document ids where positions restart (transformers' packed-sequence rule).

    A restart on a padding token (``padding`` True) starts no document: loaders pad position
    ids with zeros, and those zeros are padding, not one-token documents. Padding tokens keep
    the id of the document before them.

    Args:
        pos: [B or 1, P] position ids.
        padding: [B, P] bool, True on padding tokens, or None.

    Returns:
        [B or 1, P] int64, or None when every row holds a single document.
    """
    first = pos[:, :1] - 1
    starts = torch.diff(pos, prepend=first, dim=-1) != 1
    if padding is not None:
        starts = starts & ~padding
    docs = starts.cumsum(-1)
    if padding is None:
        single = bool((docs == docs[:, :1]).all())
    else:
        # Only real tokens count: left padding before a row's one document is not a second one.
        real = ~padding.expand_as(docs)
        low = torch.where(real, docs, docs.new_full((), 2**62)).amin(-1)
        high = torch.where(real, docs, docs.new_full((), -1)).amax(-1)
        single = bool(((low == high) | ~real.any(-1)).all())
    return None if single else docs


def _segments(docs: Tensor, padding: Tensor | None) -> Tensor:
    """[B or 1, P] int64 varlen segment ids: documents, and each padding run its own."""
    if padding is None:
        return docs.cpu()
    rows = max(docs.shape[0], padding.shape[0])
    docs, padding = docs.expand(rows, -1), padding.expand(rows, -1)
    boundary = torch.zeros_like(padding)
    boundary[:, 1:] = (docs[:, 1:] != docs[:, :-1]) | (padding[:, 1:] != padding[:, :-1])
    return boundary.cumsum(-1).cpu()


def plan_batch(
    batch: Mapping[str, Any],
    options: PlanOptions,
    *,
    hook_context: TrainContext | None = None,
    hook_layout: LayoutKind | None = None,
) -> BatchPlan:
    """Validate, pad and describe one global batch.

    Args:
        batch: the global batch (see ``ContextParallelSharder.shard``).
        options: the sharder's settings.
        hook_context: the model hook's train_ctx, if any.
        hook_layout: the layout the model hook asked for, if any.

    Raises:
        ValueError / KeyError: the batch breaks the contract; the message names the fix.
    """
    batch = {k: v for k, v in batch.items() if v is not None}
    fmt = batch.pop("qkv_format", None)
    if fmt not in (None, "bshd", "thd"):
        raise ValueError(f"qkv_format must be 'bshd' or 'thd', got {fmt!r}")
    has_ids, has_embeds = "input_ids" in batch, "inputs_embeds" in batch
    if has_ids == has_embeds:
        raise ValueError(
            "the batch must hold exactly one of input_ids and inputs_embeds, got "
            f"{'both' if has_ids else 'neither'}"
        )
    primary = batch["input_ids"] if has_ids else batch["inputs_embeds"]
    if primary.dim() < 2:
        raise ValueError(
            f"input tensor must be [B, S] (ids) or [B, S, H] (embeds), got {tuple(primary.shape)}"
        )
    bsz, seq = int(primary.shape[0]), int(primary.shape[1])
    seq_dims = {k: 1 for k in KNOWN_TOKEN_KEYS if k in batch}
    for name, dim in (options.extra_seq_buffers or {}).items():
        if name not in batch:
            raise KeyError(f"extra_seq_buffers names {name!r} but the batch has no such key")
        seq_dims[name] = dim
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be a [B, S] padding mask, got shape {tuple(mask.shape)}; "
            "the sharder builds the attention pattern itself"
        )
    pos = batch.get("position_ids")
    if pos is not None and pos.dim() == 3:
        seq_dims["position_ids"] = 2  # multi-axis rotary [3, B, S] (or [4, B, S] with text ids)
    for name, dim in seq_dims.items():
        if batch[name].shape[dim] != seq:
            raise ValueError(
                f"batch[{name!r}] has length {batch[name].shape[dim]} on dim {dim}, "
                f"expected the sequence length {seq} of the inputs"
            )
    labels = batch.get("labels")
    if labels is not None:
        num_labels = int((labels != options.ignore_index).sum())
    elif "loss_mask" in batch:
        num_labels = int(batch["loss_mask"].bool().sum())
    else:
        num_labels = 0
    passthrough = {k: v for k, v in batch.items() if k not in seq_dims and k not in SHARDER_KEYS}
    if fmt == "thd":
        return plan_thd(batch, seq_dims, passthrough, bsz, seq, num_labels, options)
    return _plan_bshd(
        batch, seq_dims, passthrough, seq, num_labels, options, hook_context, hook_layout
    )


def _padding_of(batch: Mapping[str, Any], seq: int, options: PlanOptions) -> Tensor | None:
    """[B or 1, S] bool padding of a [B, S] batch: attention_mask == 0, else trailing zeros.

    Without a mask, a trailing run of position 0 tokens without labels is padding (loaders pad
    position ids with zeros). Treating such tokens as padding never changes a real token's
    attention: they come after every real token of the row.
    """
    mask = batch.get("attention_mask")
    if mask is not None:
        return ~mask.bool()
    pos = batch.get("position_ids")
    if pos is None:
        return None
    text = pos[0] if pos.dim() == 3 else pos
    zero = text == 0
    labels = batch.get("labels")
    if labels is not None:
        zero = zero & (labels == options.ignore_index)
    trailing = _suffix(zero)
    return trailing if bool(trailing.any()) else None


def _plan_bshd(
    batch: dict[str, Any],
    seq_dims: dict[str, int],
    passthrough: dict[str, Any],
    seq: int,
    num_labels: int,
    options: PlanOptions,
    hook_context: TrainContext | None,
    hook_layout: LayoutKind | None,
) -> BatchPlan:
    cp = options.cp
    if cp == 1:
        kind, padded = LayoutKind.IDENTITY, seq
    elif hook_layout is LayoutKind.CONTIGUOUS:
        kind, padded = LayoutKind.CONTIGUOUS, layouts.round_up(seq, cp)
    else:
        kind, padded = LayoutKind.HEAD_TAIL, layouts.round_up(seq, 2 * cp)
    extra = padded - seq
    user_pos = "position_ids" in batch
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    assert primary is not None
    padding = _padding_of(batch, seq, options)
    if not user_pos:
        # [1, S] broadcasts over the batch; a [B, S] copy would cost the model extra work.
        batch["position_ids"] = torch.arange(seq, device=primary.device)[None]
        seq_dims["position_ids"] = 1
    pos = batch["position_ids"]
    tensors: dict[str, Tensor] = {}
    for name, dim in seq_dims.items():
        t = pos if name == "position_ids" else batch[name]
        if name == "position_ids":
            tensors[name] = continue_positions(t, extra)
        else:
            tensors[name] = pad_tensor(t, dim, extra, fill_value(name, t, options))
    if padding is not None or extra:
        # The sharder's own padding is padding too.
        rows = padding.shape[0] if padding is not None else 1
        base = padding if padding is not None else torch.zeros(rows, seq, dtype=torch.bool)
        padding = pad_tensor(base.to(primary.device), 1, extra, True)
    right_padded = padding is None or bool(
        (_suffix(padding) == padding).all()  # padding only as each row's trailing run
    )
    doc_ids = None
    text_pos: Tensor | None = tensors["position_ids"]
    if text_pos is not None and text_pos.dim() == 3:
        # [4, B, S]: row 0 holds the text positions (transformers' packed M-RoPE convention);
        # [3, B, S] alone carries no document boundaries.
        text_pos = text_pos[0] if text_pos.shape[0] == 4 else None
    if user_pos and text_pos is not None:
        doc_ids = docs_from_positions(text_pos, padding)
    key_valid = None
    if "attention_mask" in tensors:
        key_valid = tensors["attention_mask"].bool()
    segment_ids = None
    if doc_ids is not None:
        segment_ids = _segments(doc_ids, padding)
    return BatchPlan(
        tensors=tensors,
        seq_dims=seq_dims,
        passthrough=passthrough,
        sequence=SequencePlan(
            kind=kind, original_seq_len=seq, padded_seq_len=padded, num_label_tokens=num_labels
        ),
        doc_ids=doc_ids,
        key_valid=key_valid,
        segment_ids=segment_ids,
        right_padded=right_padded,
        thd=False,
        hook_context=hook_context,
    )
