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
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["ExpertShards"]

ATTRIBUTE = "_train_engine_expert_shards"


@dataclass(kw_only=True, slots=True, frozen=True)
class ExpertShards:
    """Parameters sharded by expert parallelism, and the groups that sync them.

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
