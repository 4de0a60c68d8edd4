"""Encoded samples, batches, and the pure functions that pad, pack and collate them.

# B batch rows, S padded sequence length, L one sample's length, P image patches,
# D values per patch, N images, K sub-sequences in a batch.

Label contract (the shift happens here, exactly once):
    `labels[b, t]` is the target for the logits at position t, i.e. `input_ids[b, t + 1]`
    when that token is an assistant target, else -100. `loss_mask = labels != -100`. Feed
    `labels` to a loss that does NOT shift again (Megatron style). HF models shift internally:
    give them `SFTBatch.hf_labels()` instead, which is unshifted.
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
    """One encoded sample, or one pack of several (then each list has one entry per part).

    Attributes:
        input_ids: [L] int64 with image placeholders expanded.
        labels: [L] int64, shifted (see the module docstring), -100 where untrained.
        position_ids: [L] int64, restarting at 0 for every packed part.
        image_mask: [L] bool, True on image placeholder tokens (for M-RoPE / token types).
        pixel_values: [P, D] patches of this sample's images in render order, or None.
        image_grid_thw: [N, 3] int64 per-image patch grid (N may be 0).
        seq_lens: length of every part (one entry unless packed).
        sample_weights: loss multiplier of every part: 0 for truncated or fully masked rows.
        source_ids: source id of every part.
    """

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    image_mask: Tensor
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
        position_ids: [B, S] int64, per packed part; 0 on padding.
        image_mask: [B, S] bool, True on image placeholder tokens.
        pixel_values: [P, D] patches of all images of the batch, concatenated, or None.
        image_grid_thw: [N, 3] int64 grids in the same order as `pixel_values`.
        cu_seqlens: [K + 1] int32 offsets into the flattened [B * S] token stream. Every part is
            a segment and so is each row's trailing padding, so the segments tile [0, B*S).
        seq_lens: [K] int32 length of every segment of `cu_seqlens`.
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
    image_mask: Tensor
    pixel_values: Tensor | None
    image_grid_thw: Tensor
    cu_seqlens: Tensor
    seq_lens: Tensor
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
    boundary; position ids restart per part.
    """
    pixels = [p.pixel_values for p in parts if p.pixel_values is not None]
    return {
        "input_ids": torch.cat([p.input_ids for p in parts]),
        "labels": torch.cat([p.labels for p in parts]),
        "position_ids": torch.cat([p.position_ids for p in parts]),
        "image_mask": torch.cat([p.image_mask for p in parts]),
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
            raise ValueError(f"sample length {n} exceeds pack capacity {capacity}")
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return [sorted(b) for b in bins]


def collate(
    samples: Sequence[EncodedSample], *, pad_token_id: int, pad_to_multiple_of: int
) -> dict[str, Any]:
    """Right-pad and stack encoded samples; concatenate their images.

    Args:
        samples: B encoded samples (or packs).
        pad_token_id: id written into padding positions.
        pad_to_multiple_of: S is the longest row rounded up to this (e.g. 2*cp). Not mutated.

    Returns:
        The `SFTBatch` fields except the Energon metadata and worker fields.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    lens = [int(s.input_ids.numel()) for s in samples]
    seq = round_up(max(lens), pad_to_multiple_of)
    b = len(samples)
    input_ids = torch.full((b, seq), pad_token_id, dtype=torch.int64)
    labels = torch.full((b, seq), IGNORE_INDEX, dtype=torch.int64)
    position_ids = torch.zeros((b, seq), dtype=torch.int64)
    image_mask = torch.zeros((b, seq), dtype=torch.bool)
    attention_mask = torch.zeros((b, seq), dtype=torch.bool)
    segments: list[int] = []
    for r, (s, n) in enumerate(zip(samples, lens, strict=True)):
        input_ids[r, :n] = s.input_ids
        labels[r, :n] = s.labels
        position_ids[r, :n] = s.position_ids
        image_mask[r, :n] = s.image_mask
        attention_mask[r, :n] = True
        segments.extend(s.seq_lens)
        if seq > n:
            segments.append(seq - n)
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
        "image_mask": image_mask,
        "pixel_values": torch.cat(pixels) if pixels else None,
        "image_grid_thw": torch.cat([s.image_grid_thw for s in samples]),
        "cu_seqlens": cu,
        "seq_lens": seg,
        "sample_weights": torch.tensor(
            [w for s in samples for w in s.sample_weights], dtype=torch.float32
        ),
        "source_ids": [i for s in samples for i in s.source_ids],
        "num_trainable_tokens": int(loss_mask.sum().item()),
    }
