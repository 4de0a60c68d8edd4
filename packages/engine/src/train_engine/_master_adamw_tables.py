"""The Triton path's device tables: which block belongs to which tensor, and where each lives.

One launch of the master-weight AdamW kernel updates a bucket of tensors (one parameter and
gradient dtype pair of a group). It reads them through two tables on the device: the blocks
(tensor index and first element of each ``BLOCK`` elements) and the five addresses of each
tensor (parameter, gradient, master weight, both moments). Building them costs host work and
a copy, so a bucket keeps them and rebuilds only the addresses when a tensor moved (a new
gradient each step), and all of them for another set of tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Bucket", "BucketKey", "block_table", "bucket_tables", "local_tensor", "to_device"]

# (group index, parameter dtype, gradient dtype)
BucketKey = tuple[int, torch.dtype, torch.dtype]


def local_tensor(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (what this rank updates), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(slots=True)
class Bucket:
    """One kernel launch: a group's tensors with one (parameter, gradient) dtype pair.

    The device-side tables were built for ``indices`` and from the addresses in ``key``;
    a new address (a moved tensor, a gradient allocated elsewhere) rebuilds ``addresses``,
    another set of indices rebuilds them all.
    """

    indices: tuple[int, ...]
    key: tuple[int, ...]
    block_tensor: Tensor
    block_offset: Tensor
    numels: Tensor
    addresses: Tensor
    step_index: Tensor
    aligned: bool


def bucket_tables(
    cache: dict[BucketKey, Bucket],
    state: Mapping[Tensor, Any],
    group_index: int,
    indices: tuple[int, ...],
    params: list[Tensor],
) -> Bucket:
    """The bucket's device tables from ``cache``, rebuilt when a tensor's address changed.

    Args:
        cache: the optimizer's buckets by (group, parameter dtype, gradient dtype); updated.
        state: the optimizer's per-parameter state (master weights, moments).
        group_index: the parameters' group.
        indices: the bucket's parameters' positions in the group.
        params: those parameters (each with a gradient).
    """
    rows: list[list[int]] = [[], [], [], [], []]
    for param in params:
        entry = state[param]
        local = local_tensor(param)
        rows[0].append(local.data_ptr())
        rows[1].append(local_tensor(param.grad).data_ptr())  # type: ignore[arg-type]
        rows[2].append(local_tensor(entry.get("master_param", param)).data_ptr())
        rows[3].append(local_tensor(entry["exp_avg"]).data_ptr())
        rows[4].append(local_tensor(entry["exp_avg_sq"]).data_ptr())
    key = tuple(address for row in rows for address in row)
    cache_key = (group_index, params[0].dtype, params[0].grad.dtype)  # type: ignore[union-attr]
    cached = cache.get(cache_key)
    if cached is not None and cached.indices == indices and cached.key == key:
        return cached
    device = local_tensor(params[0]).device
    if cached is not None and cached.indices == indices:
        # Only addresses moved (a new gradient each step): the block table stands.
        block_tensor, block_offset, numels = (
            cached.block_tensor,
            cached.block_offset,
            cached.numels,
        )
        step_index = cached.step_index
    else:
        block_tensor, block_offset, numels = block_table(params, device)
        step_index = torch.tensor(indices, dtype=torch.int64, device=device)
    addresses = to_device(torch.tensor(rows, dtype=torch.int64), device)
    bucket = Bucket(
        indices=indices,
        key=key,
        block_tensor=block_tensor,
        block_offset=block_offset,
        numels=numels,
        addresses=addresses,
        step_index=step_index,
        aligned=all(address % 16 == 0 for address in key),
    )
    cache[cache_key] = bucket
    return bucket


def block_table(params: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(tensor index per block, first element per block, numel per tensor) on ``device``."""
    from train_engine._master_adamw_triton import BLOCK

    numels = [local_tensor(p).numel() for p in params]
    counts = torch.tensor([(n + BLOCK - 1) // BLOCK for n in numels], dtype=torch.int64)
    block_tensor = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32), counts)
    starts = torch.cumsum(counts, 0) - counts
    block_offset = (torch.arange(int(counts.sum())) - starts[block_tensor.long()]) * BLOCK
    return (
        to_device(block_tensor, device),
        to_device(block_offset, device),
        to_device(torch.tensor(numels, dtype=torch.int64), device),
    )


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A host table on ``device`` without waiting for the device's queue (pinned source)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
