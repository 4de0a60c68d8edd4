"""An energon-sft batch as the inputs of a megatron-core ``GPTModel``.

# B batch rows, S padded sequence length, T = B * S tokens of a packed batch, K segments

Megatron's packed ("thd") path takes one flat row of tokens ``[1, T]`` and a ``PackedSeqParams``
whose ``cu_seqlens`` mark where every sequence starts; attention (and RoPE, which restarts per
sequence) stays inside each. energon-sft's ``cu_seqlens`` already tile the flattened ``[B * S]``
stream, every document a segment and each row's trailing padding a segment of its own, so the
padding neither sees a document nor is seen by one (and carries no loss). Labels are shifted
already (``labels[t]`` is the target of position t), which is Megatron's convention too.

Nothing here imports megatron-core: :func:`to_megatron_inputs` returns a plain dataclass and
:meth:`MegatronInputs.packed_seq_params` builds the ``PackedSeqParams`` lazily. Tested with
megatron-core 0.16.1 (the last release that installs on Python 3.11).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from energon_sft.batch import IGNORE_INDEX, SFTBatch

__all__ = ["MegatronInputs", "to_megatron_inputs"]


@dataclass(kw_only=True, slots=True, frozen=True)
class MegatronInputs:
    """``GPTModel`` inputs in Megatron's shapes.

    Attributes:
        tokens: [1, T] int64 for a packed batch ("thd"), else [B, S].
        labels: same shape, int64, already shifted; -100 where nothing is trained (Megatron
            itself wants 0 there plus ``loss_mask``: use ``labels.clamp(min=0)`` for its own
            loss functions).
        loss_mask: same shape, float32, 1.0 on trained tokens.
        position_ids: same shape, int64, restarting at 0 for every document.
        qkv_format: "thd" (packed) or "sbhd" (one document per row, causal attention).
        cu_seqlens: [K + 1] int32 segment offsets into the T tokens ("thd"), else None.
        max_seqlen: the longest segment ("thd"), else None.
    """

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    position_ids: Tensor
    qkv_format: str
    cu_seqlens: Tensor | None = None
    max_seqlen: int | None = None

    def packed_seq_params(self) -> Any:
        """megatron-core's ``PackedSeqParams`` for a packed batch, None for an unpacked one.

        The same offsets for queries and keys (self-attention); no ``*_padded`` offsets (they
        only matter for Megatron's context parallelism through Transformer Engine).

        Raises:
            ImportError: megatron-core is not installed.
        """
        if self.qkv_format != "thd":
            return None
        try:
            from megatron.core.packed_seq_params import PackedSeqParams
        except ImportError as err:
            raise ImportError(
                "packed_seq_params() needs megatron-core; install it with "
                "pip install 'train-recipes[megatron]' (or pip install megatron-core==0.16.1)"
            ) from err
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def to(self, device: torch.device | str) -> MegatronInputs:
        """A copy on ``device`` (``cu_seqlens`` too: attention kernels read it there)."""
        return MegatronInputs(
            tokens=self.tokens.to(device),
            labels=self.labels.to(device),
            loss_mask=self.loss_mask.to(device),
            position_ids=self.position_ids.to(device),
            qkv_format=self.qkv_format,
            cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens.to(device),
            max_seqlen=self.max_seqlen,
        )


def _field(batch: SFTBatch | Mapping[str, Any], name: str) -> Any:
    if isinstance(batch, Mapping):
        if name not in batch:
            raise KeyError(
                f"the batch has no {name!r}; pass an energon-sft SFTBatch or its fields "
                f"(have: {sorted(batch)})"
            )
        return batch[name]
    return getattr(batch, name)


def to_megatron_inputs(batch: SFTBatch | Mapping[str, Any]) -> MegatronInputs:
    """Turn an energon-sft batch into ``GPTModel`` inputs.

    Args:
        batch: an :class:`~energon_sft.SFTBatch`, or a mapping with its fields ``input_ids``,
            ``labels``, ``position_ids`` ([B, S] each), ``qkv_format`` (absent means
            "bshd") and, when packed, ``cu_seqlens`` [K + 1] and ``max_seqlen``.

    Returns:
        Packed ("thd") batches as one flat row [1, B * S] with the batch's segment offsets;
        unpacked ones as [B, S] rows ("sbhd": plain causal attention, right padding carries
        no loss and precedes no real token).

    Raises:
        ValueError: a batch with images (``pixel_values``): a ``GPTModel`` is text-only; or
            offsets that do not tile the tokens.
    """
    pixels = batch.get("pixel_values") if isinstance(batch, Mapping) else batch.pixel_values
    if pixels is not None:
        raise ValueError(
            "the batch carries pixel_values, but a megatron-core GPTModel is text-only; use a "
            "text dataset (or the HF backend for vision-language models)"
        )
    input_ids: Tensor = _field(batch, "input_ids")
    labels: Tensor = _field(batch, "labels")
    position_ids: Tensor = _field(batch, "position_ids")
    # A mapping without the marker holds unpacked rows (train-recipes' batch_tensors omits it).
    qkv_format = str(
        batch.get("qkv_format", "bshd") if isinstance(batch, Mapping) else batch.qkv_format
    )
    if qkv_format not in ("thd", "bshd"):
        raise ValueError(f"qkv_format={qkv_format!r}; energon-sft writes 'thd' or 'bshd'")
    if input_ids.ndim != 2 or labels.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both be "
            "[B, S]; pass a collated energon-sft batch"
        )
    loss_mask = (labels != IGNORE_INDEX).to(torch.float32)
    if qkv_format == "bshd":
        return MegatronInputs(
            tokens=input_ids,
            labels=labels,
            loss_mask=loss_mask,
            position_ids=position_ids,
            qkv_format="sbhd",
        )
    cu_seqlens: Tensor = _field(batch, "cu_seqlens").to(torch.int32)
    total = input_ids.numel()
    if cu_seqlens.ndim != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise ValueError(
            f"cu_seqlens {cu_seqlens.tolist()} must run from 0 to B * S = {total} (every "
            "document and each row's padding a segment); build the batch with energon-sft's "
            "collate"
        )
    return MegatronInputs(
        tokens=input_ids.reshape(1, total),
        labels=labels.reshape(1, total),
        loss_mask=loss_mask.reshape(1, total),
        position_ids=position_ids.reshape(1, total),
        qkv_format="thd",
        cu_seqlens=cu_seqlens,
        max_seqlen=int(_field(batch, "max_seqlen")),
    )
