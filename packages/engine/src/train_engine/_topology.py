"""What kind of data parallelism wraps a model, and over which groups gradients are averaged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from train_engine.expert_parallel import ExpertShards, find

Kind = Literal["local", "ddp", "fsdp2"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Topology:
    """How a model's gradients are synchronised.

    Attributes:
        kind: "local" (no wrapper), "ddp" or "fsdp2".
        grad_average_size: the factor the wrapper divides summed gradients by (DDP's world
            size, FSDP2's data-parallel size or custom divide factor; 1 for local modules).
        dp_groups: groups whose sequential SUM all-reduce spans the data-parallel ranks.
        fsdp_modules: the modules on which ``fully_shard`` was applied.
        experts: expert-parallel parameters kept out of the wrapper (see
            :class:`~train_engine.ExpertShards`); None without expert parallelism.
    """

    kind: Kind
    grad_average_size: int | float
    dp_groups: tuple[dist.ProcessGroup, ...]
    fsdp_modules: tuple[nn.Module, ...] = ()
    experts: ExpertShards | None = None


def _fsdp_param_groups(module: nn.Module) -> list[object]:
    state = module._get_fsdp_state()  # type: ignore[operator]
    # torch >= 2.12 may hold several parameter groups per module; 2.11 holds at most one.
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def detect_topology(model: nn.Module) -> Topology:
    """Classify ``model`` and find its gradient-averaging factor and data-parallel groups."""
    topology = _detect_wrapper(model)
    experts = find(model)
    if experts is None:
        return topology
    return Topology(
        kind=topology.kind,
        grad_average_size=topology.grad_average_size,
        dp_groups=topology.dp_groups,
        fsdp_modules=topology.fsdp_modules,
        experts=experts,
    )


def _detect_wrapper(model: nn.Module) -> Topology:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        pg: dist.ProcessGroup = model.process_group
        return Topology(kind="ddp", grad_average_size=dist.get_world_size(pg), dp_groups=(pg,))
    fsdp_modules = tuple(m for m in model.modules() if isinstance(m, FSDPModule))
    if not fsdp_modules:
        if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
            raise ValueError(
                "the model contains a DistributedDataParallel module below its root; pass the "
                "DDP wrapper itself to the Engine so it can control gradient synchronisation"
            )
        return Topology(kind="local", grad_average_size=1, dp_groups=())
    meshes: set[DeviceMesh] = set()
    factors: set[float | None] = set()
    for module in fsdp_modules:
        for param_group in _fsdp_param_groups(module):
            meshes.add(param_group.mesh_info.mesh)  # type: ignore[attr-defined]
            # None = FSDP2's default (divide by the data-parallel size).
            factors.add(getattr(param_group, "gradient_divide_factor", None))
    if len(meshes) > 1:
        raise ValueError(
            f"FSDP2 modules use {len(meshes)} different data-parallel meshes; the Engine needs "
            "one gradient-averaging group. For expert parallelism keep the experts out of "
            "fully_shard: apply_data_parallel(..., expert_shards=ExpertShards(...))"
        )
    if len(factors) > 1:
        raise ValueError(
            f"FSDP2 modules declare different gradient divide factors {sorted(map(str, factors))}; "
            "set one factor for all of them with set_gradient_divide_factor"
        )
    if not meshes:  # fully_shard on modules without parameters only
        return Topology(kind="fsdp2", grad_average_size=1, dp_groups=(), fsdp_modules=fsdp_modules)
    mesh = meshes.pop()
    factor = factors.pop()
    size: int | float = mesh.size() if factor is None else factor
    groups = tuple(mesh.get_group(d) for d in range(mesh.ndim))
    return Topology(
        kind="fsdp2", grad_average_size=size, dp_groups=groups, fsdp_modules=fsdp_modules
    )
