"""Encoded samples, batches, and the pure functions that pad, pack and collate them.

# B batch rows, S padded sequence length, L one sample's length, P image patches,
# D values per patch, N images (or documents per row, for `seq_lens`), K segments of the
# flattened [B * S] stream (every document plus each row's trailing padding).

Label contract (the shift happens here, exactly once):
    `labels[b, t]` is the target for the logits at position t, i.e. `input_ids[b, t + 1]`
    when that token is an assistant target, else -100. `loss_mask = labels != -100`. Feed
    `labels` to a loss that does NOT shift again (Megatron style). HF models shift internally:
    give them `SFTBatch.hf_labels()` instead, which is unshifted.

Document contract (what attention needs, in the two forms kernels take):
    A *document* is one encoded sample; a packed row holds several. Per row, `seq_lens[b]` lists
    the real length of every document in order (-1 where the row has fewer than N), the form
    cp-sharder's packed (`qkv_format="thd"`) path reads. Flattened, `cu_seqlens` are the
    cumulative offsets of every *segment* of the [B * S] stream and `max_seqlen` the longest,
    the form variable-length kernels take. A row's trailing padding is a segment of its own
    (`segment_is_padding`), never listed in `seq_lens`, and its position ids continue the
    row's last document instead of restarting at 0, so no reader of position ids can mistake
    padding for a document either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.energon import Batch, Sample
from megatron.energon.edataclass import edataclass
from torch import Tensor

__all__ = [
    "IGNORE_INDEX",
    "EncodedSample",
    "SFTBatch",
    "collate",
    "greedy_pack",
    "pack_samples",
    "round_up",
]

#: Label value of positions that carry no loss.
IGNORE_INDEX = -100


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


@edataclass
class EncodedSample(Sample):
    """One encoded sample, or one pack of several (then each list has one entry per document).

    Attributes:
        input_ids: [L] int64 with image placeholders expanded.
        labels: [L] int64, shifted (see the module docstring), -100 where untrained.
        position_ids: [L] int64, restarting at 0 for every packed document.
        image_mask: [L] bool, True on image placeholder tokens (for M-RoPE / token types).
        mrope_position_ids: [3, L] int64 (time, height, width) ids for M-RoPE families (built
            per document in the loader worker), None for other families.
        pixel_values: [P, D] patches of this sample's images in render order, or None.
        image_grid_thw: [N, 3] int64 per-image patch grid (N may be 0).
        seq_lens: length of every document (one entry unless packed).
        sample_weights: loss multiplier of every document: 0 for truncated or fully masked rows.
        source_ids: source id of every document.
    """

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    image_mask: Tensor
    mrope_position_ids: Tensor | None
    pixel_values: Tensor | None
    image_grid_thw: Tensor
    seq_lens: list[int]
    sample_weights: list[float]
    source_ids: list[str]


@edataclass
class SFTBatch(Batch):
    """A collated batch, right-padded to a multiple of `pad_to_multiple_of`.

    Attributes:
        input_ids: [B, S] int64, padded with the pad token.
        labels: [B, S] int64, shifted targets, -100 on prompt, image and padding positions.
        loss_mask: [B, S] float32, `labels != -100`.
        attention_mask: [B, S] bool, True on real tokens (padding False).
        position_ids: [B, S] int64, restarting at 0 for every document; on a row's trailing
            padding they continue counting from the row's last document (never 0).
        mrope_position_ids: [3, B, S] int64 M-RoPE (time, height, width) ids for M-RoPE
            families, built per document in the loader workers; padding continues like
            `position_ids`. None for other families. Prepend `position_ids` for
            transformers' [4, B, S] packed form.
        image_mask: [B, S] bool, True on image placeholder tokens.
        pixel_values: [P, D] patches of all images of the batch, concatenated, or None.
        image_grid_thw: [N, 3] int64 grids in the same order as `pixel_values`.
        qkv_format: "thd" when the encoder packs (rows of several documents: attend within
            each document only), "bshd" otherwise (one document per row, causal attention).
        seq_lens: [B, N] int32 real length of every document of each row, in order, -1 past a
            row's last document (N = most documents in a row). Padding is never listed.
        cu_seqlens: [K + 1] int32 offsets into the flattened [B * S] token stream. Every
            document is a segment and so is each row's trailing padding, so the segments tile
            [0, B*S).
        segment_lengths: [K] int32 length of every segment of `cu_seqlens`.
        segment_is_padding: [K] bool, True for the padding segments.
        max_seqlen: the longest segment of `cu_seqlens` (what variable-length kernels take).
        sample_weights: [M] float32 loss multiplier per sample (M samples, packed or not).
        source_ids: M source ids, in the order of `sample_weights`.
        num_trainable_tokens: number of ones in `loss_mask` (this rank only).
        worker_stats: bad-sample counters of the producing worker (cumulative).
        worker_id: id of the producing worker within its loader.
        logical_shard: the logical loader shard that produced this batch (set by the loader).
        shard_step: the index of this batch within its logical shard's stream.
    """

    input_ids: Tensor
    labels: Tensor
    loss_mask: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    mrope_position_ids: Tensor | None
    image_mask: Tensor
    pixel_values: Tensor | None
    image_grid_thw: Tensor
    qkv_format: str
    seq_lens: Tensor
    cu_seqlens: Tensor
    segment_lengths: Tensor
    segment_is_padding: Tensor
    max_seqlen: int
    sample_weights: Tensor
    source_ids: list[str]
    num_trainable_tokens: int
    worker_stats: dict[str, int]
    worker_id: int = 0
    logical_shard: int = -1
    shard_step: int = -1

    def hf_labels(self) -> Tensor:
        """[B, S] unshifted labels for HF models (which shift internally): -100 where untrained."""
        out = torch.full_like(self.labels, IGNORE_INDEX)
        out[:, 1:] = self.labels[:, :-1]
        return out


def pack_samples(parts: Sequence[EncodedSample]) -> dict[str, Any]:
    """Concatenate encoded samples into the fields of one packed `EncodedSample`.

    Each part's labels already end in -100 (no next token), so no target crosses a part
    boundary; position ids (and M-RoPE ids) restart per part.
    """
    pixels = [p.pixel_values for p in parts if p.pixel_values is not None]
    mrope = [p.mrope_position_ids for p in parts if p.mrope_position_ids is not None]
    if mrope and len(mrope) != len(parts):
        raise ValueError(
            f"{len(mrope)} of {len(parts)} parts carry mrope_position_ids; the encoder builds "
            "them for every sample of an M-RoPE family or for none"
        )
    return {
        "input_ids": torch.cat([p.input_ids for p in parts]),
        "labels": torch.cat([p.labels for p in parts]),
        "position_ids": torch.cat([p.position_ids for p in parts]),
        "image_mask": torch.cat([p.image_mask for p in parts]),
        "mrope_position_ids": torch.cat(mrope, dim=-1) if mrope else None,
        "pixel_values": torch.cat(pixels) if pixels else None,
        "image_grid_thw": torch.cat([p.image_grid_thw for p in parts]),
        "seq_lens": [n for p in parts for n in p.seq_lens],
        "sample_weights": [w for p in parts for w in p.sample_weights],
        "source_ids": [s for p in parts for s in p.source_ids],
    }


def greedy_pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing bins of indices whose lengths sum to <= capacity.

    Deterministic (ties keep buffer order), so the packer needs no RNG to be restorable.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(
                f"sample {i} has {n} tokens, more than the pack capacity {capacity} "
                f"(max_length); nothing is cut here: raise max_length to >= {n}, or let the "
                "encoder truncate or skip over-long samples (overlong='truncate'|'skip')"
            )
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return [sorted(b) for b in bins]


def _continue(last: Tensor, amount: int) -> Tensor:
    """[..., amount] ids counting on from `last` [..., 1]: padding that restarts nothing."""
    return last + torch.arange(1, amount + 1, dtype=last.dtype)


def collate(
    samples: Sequence[EncodedSample],
    *,
    pad_token_id: int,
    pad_to_multiple_of: int,
    qkv_format: str = "bshd",
) -> dict[str, Any]:
    """Right-pad and stack encoded samples; concatenate their images.

    Args:
        samples: B encoded samples (or packs).
        pad_token_id: id written into padding positions.
        pad_to_multiple_of: S is the longest row rounded up to this (e.g. 2*cp). Not mutated.
        qkv_format: "thd" for packed rows, "bshd" for one document per row.

    Returns:
        The `SFTBatch` fields except the Energon metadata and worker fields.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    if qkv_format not in ("thd", "bshd"):
        raise ValueError(f"qkv_format={qkv_format!r}; expected 'thd' (packed) or 'bshd'")
    with_mrope = [s.mrope_position_ids is not None for s in samples]
    if any(with_mrope) and not all(with_mrope):
        raise ValueError(
            f"{sum(with_mrope)} of {len(samples)} rows carry mrope_position_ids; the encoder "
            "builds them for every sample of an M-RoPE family or for none"
        )
    lens = [int(s.input_ids.numel()) for s in samples]
    for r, (s, n) in enumerate(zip(samples, lens, strict=True)):
        if sum(s.seq_lens) != n or min(s.seq_lens, default=0) < 1:
            raise ValueError(
                f"row {r} has {n} tokens but its documents' seq_lens {s.seq_lens} (each >= 1) "
                "do not add up to that; build rows with pack_samples"
            )
    seq = round_up(max(lens), pad_to_multiple_of)
    b = len(samples)
    docs = max(len(s.seq_lens) for s in samples)
    input_ids = torch.full((b, seq), pad_token_id, dtype=torch.int64)
    labels = torch.full((b, seq), IGNORE_INDEX, dtype=torch.int64)
    position_ids = torch.zeros((b, seq), dtype=torch.int64)
    mrope = torch.zeros((3, b, seq), dtype=torch.int64) if all(with_mrope) else None
    image_mask = torch.zeros((b, seq), dtype=torch.bool)
    attention_mask = torch.zeros((b, seq), dtype=torch.bool)
    seq_lens = torch.full((b, docs), -1, dtype=torch.int32)
    segments: list[int] = []
    is_padding: list[bool] = []
    for r, (s, n) in enumerate(zip(samples, lens, strict=True)):
        input_ids[r, :n] = s.input_ids
        labels[r, :n] = s.labels
        position_ids[r, :n] = s.position_ids
        image_mask[r, :n] = s.image_mask
        attention_mask[r, :n] = True
        seq_lens[r, : len(s.seq_lens)] = torch.tensor(s.seq_lens, dtype=torch.int32)
        segments.extend(s.seq_lens)
        is_padding.extend([False] * len(s.seq_lens))
        if mrope is not None:
            assert s.mrope_position_ids is not None
            mrope[:, r, :n] = s.mrope_position_ids
        if seq > n:
            segments.append(seq - n)
            is_padding.append(True)
            position_ids[r, n:] = _continue(position_ids[r, n - 1 : n], seq - n)
            if mrope is not None:
                mrope[:, r, n:] = _continue(mrope[:, r, n - 1 : n], seq - n)
    seg = torch.tensor(segments, dtype=torch.int32)
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seg, 0)
    pixels = [s.pixel_values for s in samples if s.pixel_values is not None]
    loss_mask = (labels != IGNORE_INDEX).to(torch.float32)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "mrope_position_ids": mrope,
        "image_mask": image_mask,
        "pixel_values": torch.cat(pixels) if pixels else None,
        "image_grid_thw": torch.cat([s.image_grid_thw for s in samples]),
        "qkv_format": qkv_format,
        "seq_lens": seq_lens,
        "cu_seqlens": cu,
        "segment_lengths": seg,
        "segment_is_padding": torch.tensor(is_padding, dtype=torch.bool),
        "max_seqlen": int(seg.max()),
        "sample_weights": torch.tensor(
            [w for s in samples for w in s.sample_weights], dtype=torch.float32
        ),
        "source_ids": [i for s in samples for i in s.source_ids],
        "num_trainable_tokens": int(loss_mask.sum().item()),
    }
