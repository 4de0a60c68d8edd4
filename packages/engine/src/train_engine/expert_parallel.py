"""Expert-parallel parameters: kept out of the data-parallel wrapper, synchronised by the Engine.

Under expert parallelism (EP) each rank of an ep group holds different experts, and tokens
reach them through an all-to-all whose backward brings every token's gradient to the expert's
owner. Such parameters must not be averaged over the whole data-parallel group like the dense
ones. At the window's boundary the Engine:

1. sums their gradients over the ``replica_group`` (the ranks holding the same experts in
   other ep groups), then divides them by the wrapper's averaging factor G. Under the
   token-sum contract every rank's loss is scaled by G / N, so an expert's gradient summed
   over all ranks' tokens and divided by G is exactly d(sum of token losses)/dW / N, the
   dense parameters' scaling;
2. counts them in the global gradient norm once: their squared local norms are summed over
   the ep group (distinct experts) and taken from one replica.

Checkpoints (:func:`checkpoint_views`) save each expert parameter, and its optimizer state,
as a DTensor sharded on dim 0 over the ep group, so the distributed checkpoint keeps every ep
rank's experts (replicas write theirs once) and reshards them on load, to another ep degree
or to one process holding all experts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["ExpertShards", "checkpoint_views"]

ATTRIBUTE = "_train_engine_expert_shards"


@dataclass(kw_only=True, slots=True, frozen=True)
class ExpertShards:
    """Parameters sharded by expert parallelism, and the groups that sync them.

    Each parameter is this rank's dim-0 slice of a global tensor: the ep group's ranks hold
    consecutive, equal slices in group-rank order (ep rank r holds rows r*n .. (r+1)*n-1, as
    moe-dispatch shards experts by index). Checkpoints rely on this layout.

    Attributes:
        params: this rank's expert parameters (plain tensors, one ep shard each).
        ep_group: ranks holding different experts of the same layers (their gradients are
            disjoint parts of the global norm); None for the default group.
        replica_group: ranks holding the same experts as this one (their gradients are summed);
            None when every expert lives on one rank only.
    """

    params: tuple[nn.Parameter, ...]
    ep_group: dist.ProcessGroup | None = None
    replica_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not self.params:
            raise ValueError("ExpertShards needs at least one expert parameter")
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.params):
            raise ValueError(
                "expert parameters must be plain tensors (this rank's experts); leave them out "
                "of fully_shard and tensor parallelism"
            )


def ddp_ignored_names(model: nn.Module, ignored: set[nn.Parameter]) -> list[str]:
    """The names under which DDP must be told to leave ``ignored`` alone.

    DDP reads its ignore list under two spellings: its broadcast and parameter list use
    ``named_parameters()`` names (``experts``), but its gradient reducer builds
    ``f"{module_name}.{param_name}"``, which for a parameter of the root module itself reads
    ``.experts``. With only the first spelling, such a parameter is still all-reduced
    (averaged over ranks holding different experts: wrong gradients). Both are listed.
    """
    ids = {id(p) for p in ignored}
    names = {name for name, p in model.named_parameters() if id(p) in ids}
    for module_name, module in model.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            if id(p) in ids:
                names.add(f"{module_name}.{param_name}")
    return sorted(names)


def attach(model: nn.Module, shards: ExpertShards) -> None:
    """Record ``shards`` on the (wrapped) model, where the Engine finds them."""
    setattr(model, ATTRIBUTE, shards)


def find(model: nn.Module) -> ExpertShards | None:
    """The expert shards recorded on ``model`` (or on the module a DDP wrapper holds)."""
    shards = getattr(model, ATTRIBUTE, None)
    if shards is None and hasattr(model, "module"):
        shards = getattr(model.module, ATTRIBUTE, None)
    return shards if isinstance(shards, ExpertShards) else None


@torch.no_grad()
def finalize_grads(shards: ExpertShards, grad_average_size: int | float) -> None:
    """Sum expert gradients over the replicas and divide by the wrapper's averaging factor."""
    grads = [p.grad for p in shards.params if p.grad is not None]
    if not grads:
        return
    if shards.replica_group is not None and dist.get_world_size(shards.replica_group) > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=shards.replica_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    if grad_average_size != 1:
        torch._foreach_mul_(grads, 1.0 / grad_average_size)


@torch.no_grad()
def norm_stat(
    params: Iterable[Tensor], norm_type: float, group: dist.ProcessGroup | None
) -> Tensor:
    """The float64 sum of |g|^p (or the max for inf) of expert gradients over the ep group."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    backend_device = _group_device(group, device)
    if math.isinf(norm_type):
        stat = torch.zeros((), dtype=torch.float64, device=backend_device)
        for g in grads:
            stat = torch.maximum(stat, g.detach().abs().max().to(backend_device, torch.float64))
        dist.all_reduce(stat, op=dist.ReduceOp.MAX, group=group)
    else:
        stat = torch.zeros((), dtype=torch.float64, device=backend_device)
        for g in grads:
            stat = stat + g.detach().to(torch.float64).abs().pow(norm_type).sum().to(backend_device)
        dist.all_reduce(stat, group=group)
    return stat.to(device)


def _group_device(group: dist.ProcessGroup | None, fallback: torch.device) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if backend == "gloo" else fallback


def grad_norm(
    params: Iterable[Tensor],
    shards: ExpertShards,
    norm_type: float,
    grad_average_size: int | float,
) -> Tensor:
    """Finalize the expert gradients, then the global norm of dense and expert gradients.

    Args:
        params: every trainable parameter (dense and expert).
        shards: the expert parameters among them and their groups.
        norm_type: p (``inf`` allowed).
        grad_average_size: the data-parallel wrapper's averaging factor.

    Returns:
        0-dim float64 tensor, identical on every rank.
    """
    from train_engine.grad_norm import global_grad_norm

    finalize_grads(shards, grad_average_size)
    expert_ids = {id(p) for p in shards.params}
    dense = global_grad_norm([p for p in params if id(p) not in expert_ids], norm_type)
    stat = norm_stat(shards.params, norm_type, shards.ep_group).to(dense.device)
    if math.isinf(norm_type):
        return torch.maximum(dense, stat)
    return (dense.pow(norm_type) + stat).pow(1.0 / norm_type)


def checkpoint_views(
    model: nn.Module, model_state: dict[str, Any], optim_state: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state dicts to hand to the distributed checkpoint, expert shards as DTensors.

    Plain expert tensors carry the same names on every ep rank, so DCP would keep one rank's
    experts only. Each expert parameter (found by storage among ``model_state``'s values) and
    each of its optimizer-state tensors of the same shape becomes a DTensor view sharded on
    dim 0 over the ep group: saved shard by shard (replicas hold equal shards, which DCP writes
    once), and loaded in place into the plain tensors, resharded from any saved layout.

    Args:
        model: the (wrapped) model, with or without :class:`ExpertShards` attached.
        model_state: from ``get_state_dict``; not modified.
        optim_state: from ``get_state_dict`` (``{"state": {fqn: {...}}, "param_groups": ...}``).

    Returns:
        (model dict, optimizer dict): the inputs themselves without expert parallelism (no
        shards, or an ep group of one rank); otherwise shallow copies whose expert entries are
        DTensor views sharing storage with the originals.

    Raises:
        ValueError: an expert parameter has no entry in ``model_state``.
    """
    shards = find(model)
    if shards is None or shards.ep_group is None or dist.get_world_size(shards.ep_group) == 1:
        return model_state, optim_state
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    # No new process group: a mesh over the existing ep group, for the DTensor layout only.
    mesh = DeviceMesh.from_group(shards.ep_group, shards.params[0].device.type)

    def as_dtensor(local: Tensor) -> Tensor:
        # Equal slices on every ep rank: the global shape follows without communication.
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    by_storage = {
        (value.data_ptr(), tuple(value.shape)): name
        for name, value in model_state.items()
        if isinstance(value, Tensor) and not isinstance(value, DTensor)
    }
    names: dict[str, tuple[int, ...]] = {}
    for param in shards.params:
        name = by_storage.get((param.data_ptr(), tuple(param.shape)))
        if name is None:
            raise ValueError(
                f"an expert parameter of shape {tuple(param.shape)} is not in the model's state "
                "dict; ExpertShards.params must be parameters of the checkpointed model"
            )
        names[name] = tuple(param.shape)
    model_view = {k: as_dtensor(v) if k in names else v for k, v in model_state.items()}
    optim_view = dict(optim_state)
    states = optim_state.get("state")
    if isinstance(states, dict):
        optim_view["state"] = {
            key: (
                {
                    k: as_dtensor(v)
                    if isinstance(v, Tensor) and tuple(v.shape) == names[key]
                    else v
                    for k, v in entry.items()
                }
                if key in names and isinstance(entry, dict)
                else entry
            )
            for key, entry in states.items()
        }
    return model_view, optim_view
