"""Private process-group helpers: mesh resolution and a differentiable sequence all-gather."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class CPGroup:
    """The context-parallel group bound by a sharder.

    Attributes:
        size: W, number of CP ranks (1 when no mesh is given).
        rank: this process's rank inside the CP group.
        group: the process group, None when size == 1 and no mesh was given.
        mesh: the 1-D CP DeviceMesh, None when no mesh was given.
        tp_mesh: the 1-D TP DeviceMesh when the mesh names a "tp" dimension.
    """

    size: int
    rank: int
    group: Any = None
    mesh: Any = None
    tp_mesh: Any = None


def resolve_cp_group(device_mesh: Any) -> CPGroup:
    """Bind the CP (and optional TP) sub-meshes of ``device_mesh``.

    Args:
        device_mesh: None (cp=1), a 1-D DeviceMesh (all of it is CP), or a DeviceMesh with a
            dimension named "cp" (and optionally "tp").

    Raises:
        ValueError: a multi-dimensional mesh without a "cp" dimension, or a CP mesh whose process
            group disagrees with the mesh (size or rank).
    """
    if device_mesh is None:
        return CPGroup(size=1, rank=0)
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    tp_mesh = device_mesh["tp"] if "tp" in names else None
    if "cp" in names:
        cp_mesh = device_mesh["cp"] if device_mesh.ndim > 1 else device_mesh
    elif device_mesh.ndim == 1:
        cp_mesh = device_mesh
    else:
        raise ValueError(
            f"device_mesh has {device_mesh.ndim} dimensions named {names}, none of them 'cp'; "
            "pass a 1-D mesh or name the context-parallel dimension 'cp' "
            "(init_device_mesh(..., mesh_dim_names=('dp', 'cp')))"
        )
    group = cp_mesh.get_group()
    size = cp_mesh.size()
    group_size = dist.get_world_size(group)
    if group_size != size:
        raise ValueError(
            f"the cp mesh has {size} ranks but its process group has {group_size}; "
            "build the mesh with init_device_mesh on the same process group"
        )
    rank = dist.get_rank(group)
    mesh_rank = cp_mesh.get_local_rank()
    if rank != mesh_rank:
        raise ValueError(
            f"this process is rank {rank} of the cp process group but coordinate {mesh_rank} of "
            "the cp mesh; the mesh does not match the process group"
        )
    return CPGroup(size=size, rank=rank, group=group, mesh=cp_mesh, tp_mesh=tp_mesh)


def _all_gather_cat(x: Tensor, dim: int, group: Any, size: int) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_own_slice(grad: Tensor, dim: int, group: Any, size: int, rank: int) -> Tensor:
    """Sum ``grad`` over the group and keep this rank's slice along ``dim``."""
    local = grad.shape[dim] // size
    if dist.get_backend(group) == "nccl":
        moved = grad.movedim(dim, 0).contiguous()
        out = torch.empty((local, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
        dist.reduce_scatter_tensor(out, moved, group=group)
        return out.movedim(0, dim)
    # Gloo has no reduce-scatter: a full all-reduce, then the own slice.
    summed = grad.contiguous()
    dist.all_reduce(summed, group=group)
    return summed.narrow(dim, rank * local, local)


class _SeqAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Any, size: int, rank: int) -> Tensor:
        ctx.dim, ctx.group, ctx.size, ctx.rank = dim, group, size, rank
        return _all_gather_cat(x, dim, group, size)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (
            _reduce_own_slice(grad, ctx.dim, ctx.group, ctx.size, ctx.rank),
            None,
            None,
            None,
            None,
        )


def all_gather_seq(x: Tensor, *, dim: int, cp: CPGroup) -> Tensor:
    """Concatenate every CP rank's ``x`` along ``dim`` in rank order, differentiably.

    The backward sums the incoming gradient over the CP ranks and returns each rank its own
    slice (a reduce-scatter), so a token's gradient collects every rank's contribution and lands
    on the rank that owns the token.

    Args:
        x: [..., S_local, ...] with the same shape on every rank.
        dim: the sequence dimension.
        cp: the CP group.

    Returns:
        [..., W * S_local, ...].
    """
    if cp.size == 1:
        return x
    return _SeqAllGather.apply(x, dim, cp.group, cp.size, cp.rank)


def agree(values: list[int], cp: CPGroup, what: str) -> None:
    """Raise on every CP rank unless all ranks hold the same ``values``.

    Every rank takes part in the same all-gather and sees the same result, so a mismatch raises
    everywhere instead of leaving some ranks blocked in a later collective.
    """
    if cp.size == 1:
        return
    device = torch.device("cpu")
    if dist.get_backend(cp.group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(cp.size)]
    dist.all_gather(parts, mine, group=cp.group)
    table = torch.stack(parts).cpu()
    if not bool((table == table[0]).all()):
        raise ValueError(
            f"context-parallel ranks disagree on {what}: per-rank values {table.tolist()}; "
            "every CP rank must receive the same global batch"
        )
