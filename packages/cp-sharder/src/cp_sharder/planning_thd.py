"""Planning of packed (THD) batches: rows of documents flattened into one token stream.

THD scheme. Rows ``[B, S]`` holding documents of real lengths ``seq_lens`` ``[B, N]`` (negative
= absent) and optional ``seq_lens_padded`` are flattened into one stream ``[1, T]``, ``T = B*S``;
each row's unused tail becomes a padding sequence of its own. Under context parallelism:

- when every padded sequence length is a multiple of ``2*cp`` (the loader padded each document,
  energon-sft ``pad_to_multiple_of=2*cp``), the layout is per-document head/tail (Transformer
  Engine's ``thd_get_partitioned_indices``): rank r holds chunks r and 2W-1-r of *every*
  document, so each rank does exactly 1/W of every document's causal work;
- otherwise the stream is padded at its end to a multiple of ``2*cp`` and laid out head/tail as
  a whole (torch's and Megatron's load balancer). No token is inserted inside the stream, so the
  token tensors keep the loader's shapes; causal work is balanced on average (exactly for a
  document spanning the stream). Transformer Engine cannot run this layout and raises instead.

Either way ``shard_token_tensor``/``gather_token_tensor`` are exact inverses (the layout is a
permutation of the padded stream).

Dimension letters: B batch, S row length, T packed tokens (B*S), P padded stream, W cp size,
N packed sequences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cp_sharder import layouts
from cp_sharder._plan_common import (
    BatchPlan,
    PlanOptions,
    SequencePlan,
    continue_positions,
    fill_value,
    pad_tensor,
)
from cp_sharder.layouts import LayoutKind

__all__ = ["plan_thd"]


def _row_lengths(batch: dict[str, Any], bsz: int, seq: int, cp: int) -> tuple[list[int], list[int]]:
    """Per-sequence real and padded lengths over all rows, trailing row padding included."""
    real = torch.as_tensor(batch["seq_lens"]).reshape(bsz, -1).cpu().long()
    explicit = "seq_lens_padded" in batch
    padded_lens = torch.as_tensor(batch.get("seq_lens_padded", real)).reshape(bsz, -1).cpu().long()
    if padded_lens.shape != real.shape:
        raise ValueError(
            f"seq_lens_padded has shape {tuple(padded_lens.shape)}, seq_lens {tuple(real.shape)}"
        )
    seg_real: list[int] = []
    seg_padded: list[int] = []
    for b in range(bsz):
        keep = real[b] >= 0
        row_real, row_pad = real[b][keep].tolist(), padded_lens[b][keep].tolist()
        for i, (r_len, p_len) in enumerate(zip(row_real, row_pad, strict=True)):
            if p_len < r_len:
                raise ValueError(
                    f"row {b}: padded length {p_len} is shorter than the real length {r_len}"
                )
            if r_len > seq:
                raise ValueError(
                    f"row {b}: document {i} has {r_len} tokens, longer than the row ({seq} "
                    "tokens); split or truncate it in the loader (max_length), nothing is "
                    "truncated here"
                )
            if explicit and cp > 1 and p_len % (2 * cp):
                raise ValueError(
                    f"row {b}: document {i} has padded length {p_len} (seq_lens_padded), not a "
                    f"multiple of 2*cp={2 * cp}: the loader padded for another cp. Pad each "
                    f"document to a multiple of {2 * cp} (energon-sft: pad_to_multiple_of="
                    f"{2 * cp}) or pass no seq_lens_padded (head/tail over the stream)"
                )
        used = sum(row_pad)
        if used > seq:
            raise ValueError(
                f"row {b}: packed sequences take {used} tokens but the row holds {seq}; seq_lens "
                "(and seq_lens_padded) must describe the documents of their own row"
            )
        if used < seq:
            # Trailing row padding becomes its own padding-only sequence.
            row_real.append(0)
            row_pad.append(seq - used)
        seg_real += row_real
        seg_padded += row_pad
    return seg_real, seg_padded


def plan_thd(
    batch: dict[str, Any],
    seq_dims: dict[str, int],
    passthrough: dict[str, Any],
    bsz: int,
    seq: int,
    num_labels: int,
    options: PlanOptions,
) -> BatchPlan:
    """Plan a packed batch (see the module docstring for the scheme)."""
    cp = options.cp
    if "seq_lens" not in batch:
        raise KeyError(
            "a packed batch (qkv_format='thd') needs 'seq_lens': [B, N] real lengths of the "
            "sequences packed in each row (negative entries are ignored)"
        )
    seg_real, seg_padded = _row_lengths(batch, bsz, seq, cp)
    total = bsz * seq
    divisible = all(p % (2 * cp) == 0 for p in seg_padded)
    if options.te and not divisible:
        bad = next(p for p in seg_padded if p % (2 * cp))
        raise ValueError(
            f"Transformer Engine THD context parallelism needs every packed sequence padded to a "
            f"multiple of 2*cp={2 * cp}; found a padded length {bad}. Pad each sequence "
            f"(seq_lens_padded) to a multiple of {2 * cp} (energon-sft: pad_to_multiple_of={2 * cp})"
        )
    if cp == 1:
        kind, padded = LayoutKind.IDENTITY, total
    elif divisible:
        kind, padded = LayoutKind.THD, total
    else:
        kind, padded = LayoutKind.HEAD_TAIL, layouts.round_up(total, 2 * cp)
    extra = padded - total
    if extra:
        seg_real.append(0)
        seg_padded.append(extra)
    lens = torch.tensor(seg_padded, dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    seg_of_token = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    offset_in_seg = torch.arange(padded) - cu[:-1][seg_of_token]
    real_t = torch.tensor(seg_real, dtype=torch.int64)
    real_token = offset_in_seg < real_t[seg_of_token]
    key_valid = real_token[None]
    doc_ids = seg_of_token[None]
    primary: Tensor = batch["input_ids"] if "input_ids" in batch else batch["inputs_embeds"]
    device = primary.device
    if "position_ids" not in batch:
        batch["position_ids"] = offset_in_seg[:total].reshape(bsz, seq).to(device)
        seq_dims["position_ids"] = 1
    tensors: dict[str, Tensor] = {}
    for name, dim in seq_dims.items():
        t = batch[name]
        if name == "position_ids" and t.dim() == 3:
            flat = t.reshape(t.shape[0], 1, total)
            tensors[name] = continue_positions(flat, extra)
            continue
        if dim != 1:
            raise ValueError(
                f"packed batches need token buffers as [B, S, ...]; {name!r} has seq dim {dim}"
            )
        flat = t.reshape(1, total, *t.shape[2:])
        if name == "position_ids":
            tensors[name] = continue_positions(flat, extra)
        else:
            tensors[name] = pad_tensor(flat, 1, extra, fill_value(name, t, options))
        seq_dims[name] = 1
    if "position_ids" in tensors and tensors["position_ids"].dim() == 3:
        seq_dims["position_ids"] = 2
    if "attention_mask" in tensors:
        mask = tensors["attention_mask"].bool().cpu()
        hole = real_token[None] & ~mask
        if bool(hole.any()):
            at = int(hole.flatten().nonzero()[0])
            raise ValueError(
                f"attention_mask is 0 at packed token {at} (row {at // seq}, column {at % seq}), "
                "which seq_lens counts as a real document token; in a packed batch padding is "
                "described by seq_lens/seq_lens_padded: fix the mask or the lengths"
            )
        key_valid = key_valid & mask
    return BatchPlan(
        tensors=tensors,
        seq_dims=seq_dims,
        passthrough=passthrough,
        sequence=SequencePlan(
            kind=kind,
            original_seq_len=total,
            padded_seq_len=padded,
            input_row_shape=(bsz, seq),
            cu_seqlens_padded=cu,
            num_label_tokens=num_labels,
        ),
        doc_ids=doc_ids.to(device),
        key_valid=key_valid.to(device),
        segment_ids=doc_ids,
        right_padded=False,
        thd=True,
        hook_context=None,
    )
