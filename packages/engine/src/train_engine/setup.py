"""Wrap a model for data parallelism: DDP or FSDP2 (``fully_shard``), with validated knobs."""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from train_engine.dp_config import DDPConfig, DTypeName, FSDP2Config
from train_engine.expert_parallel import ExpertShards, attach, ddp_ignored_names

__all__ = ["DDPConfig", "DTypeName", "FSDP2Config", "apply_data_parallel"]

logger = logging.getLogger(__name__)


def _resolve_dtype(field: str, value: DTypeName | torch.dtype | None) -> torch.dtype | None:
    """A dtype field of :class:`FSDP2Config` as a ``torch.dtype`` (names resolved here)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    resolved = getattr(torch, str(value), None)
    if value not in ("float32", "bfloat16", "float16") or not isinstance(resolved, torch.dtype):
        raise ValueError(
            f"FSDP2Config.{field}={value!r} is not a dtype; use 'float32', 'bfloat16', "
            "'float16', a torch.dtype or None"
        )
    return resolved


def _find_blocks(
    model: nn.Module, block_types: tuple[type[nn.Module], ...] | None
) -> list[nn.Module]:
    if block_types is not None:
        return [m for m in model.modules() if isinstance(m, block_types) and m is not model]
    # A transformer keeps its blocks in one ModuleList (torchtitan `layers`, HF `model.layers`);
    # the one holding the most parameters is the stack of blocks.
    best: list[nn.Module] = []
    best_numel = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = list(module), numel
    return best


def apply_data_parallel(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    config: DDPConfig | FSDP2Config,
    gradient_accumulation_steps: int = 1,
    block_types: tuple[type[nn.Module], ...] | None = None,
    expert_shards: ExpertShards | None = None,
) -> nn.Module:
    """Apply DDP, or FSDP2 per transformer block and then at the root, on a device mesh.

    Tensor parallelism (if any) must already be applied: FSDP2 then shards the DTensor
    parameters along ``mesh`` too (pass the data-parallel sub-mesh, e.g. ``mesh["dp"]``).

    Args:
        model: the module, already on its device (CPU for gloo, the rank's GPU for NCCL).
        mesh: data-parallel mesh; 1-D for DDP and FSDP2, 2-D ``(replicate, shard)`` for HSDP.
        config: :class:`DDPConfig` or :class:`FSDP2Config`.
        gradient_accumulation_steps: the planned window, used to reject combinations the
            wrappers do not support (DDP ``static_graph`` with accumulation).
        block_types: module classes sharded as one FSDP2 unit each; None picks the children of
            the largest ``nn.ModuleList`` (the transformer blocks of common model layouts).
        expert_shards: expert-parallel parameters to leave out of the wrapper (DDP does not
            broadcast or all-reduce them, FSDP2 does not shard them); the Engine syncs and
            clips them instead.

    Returns:
        The DDP wrapper, or ``model`` itself (``fully_shard`` works in place) for FSDP2.
    """
    if gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}"
        )
    ignored: set[nn.Parameter] = set()
    if expert_shards is not None:
        ignored = set(expert_shards.params)
        owned = {id(p) for p in model.parameters()}
        if any(id(p) not in owned for p in ignored):
            raise ValueError("expert_shards holds parameters that are not the model's")
    wrapped: nn.Module
    if isinstance(config, DDPConfig):
        wrapped = _apply_ddp(
            model,
            mesh=mesh,
            config=config,
            accumulation=gradient_accumulation_steps,
            ignored=ignored,
        )
    elif isinstance(config, FSDP2Config):
        wrapped = _apply_fsdp2(
            model, mesh=mesh, config=config, block_types=block_types, ignored=ignored
        )
    else:
        raise TypeError(f"config must be a DDPConfig or FSDP2Config, got {type(config).__name__}")
    if expert_shards is not None:
        attach(wrapped, expert_shards)
    return wrapped


def _apply_ddp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    config: DDPConfig,
    accumulation: int,
    ignored: set[nn.Parameter],
) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    if mesh.ndim != 1:
        raise ValueError(
            f"DDP needs a 1-D data-parallel mesh, got a {mesh.ndim}-D mesh "
            f"{mesh.mesh_dim_names}; pass the data-parallel sub-mesh, e.g. mesh['dp']"
        )
    if config.static_graph and accumulation > 1:
        raise ValueError(
            f"DDPConfig(static_graph=True) cannot be combined with gradient accumulation "
            f"(gradient_accumulation_steps={accumulation}): DDP's static graph does not support "
            "no_sync(); set static_graph=False, or accumulate only with gradient_accumulation_steps=1"
        )
    if config.bucket_cap_mb is not None and not config.bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0 or None, got {config.bucket_cap_mb}")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "the model has DTensor (tensor-parallel) parameters, which DDP cannot reduce; "
            "use FSDP2Config for TP models"
        )
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise ValueError(
            f"DDP needs all parameters on one device, found {sorted(map(str, devices))}"
        )
    device = devices.pop()
    kwargs: dict[str, object] = {}
    # torch >= 2.12 renamed the forward-time buffer broadcast to forward_sync_buffers (and warns
    # on the old name); 2.11 only knows broadcast_buffers. Both mean "sync buffers every forward".
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = config.broadcast_buffers
    else:
        kwargs["broadcast_buffers"] = config.broadcast_buffers
    if config.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = config.bucket_cap_mb
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, ddp_ignored_names(model, ignored)
        )
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh.get_group(),
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        **kwargs,  # type: ignore[arg-type]
    )


def _apply_fsdp2(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    config: FSDP2Config,
    block_types: tuple[type[nn.Module], ...] | None,
    ignored: set[nn.Parameter],
) -> nn.Module:
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"FSDP2 takes a 1-D (shard) or 2-D (replicate, shard) mesh, got {mesh.ndim}-D "
            f"{mesh.mesh_dim_names}; pass the data-parallel sub-mesh, e.g. mesh['dp']"
        )
    if config.cpu_offload and config.param_dtype is not None:
        logger.info(
            "FSDP2 CPU offload with param_dtype=%s: casts happen on the GPU", config.param_dtype
        )
    policy = MixedPrecisionPolicy(
        param_dtype=_resolve_dtype("param_dtype", config.param_dtype),
        reduce_dtype=_resolve_dtype("reduce_dtype", config.reduce_dtype),
        output_dtype=_resolve_dtype("output_dtype", config.output_dtype),
        cast_forward_inputs=config.cast_forward_inputs,
    )
    offload = CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy()
    blocks = _find_blocks(model, block_types)
    if not blocks:
        logger.warning(
            "no transformer blocks found (no nn.ModuleList and no block_types): the whole "
            "model is one FSDP2 unit, so all parameters are gathered at once"
        )
    for i, block in enumerate(blocks):
        reshard = config.reshard_after_forward
        if reshard is None:
            reshard = i < len(blocks) - 1
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=policy,
            offload_policy=offload,
            ignored_params=ignored or None,
        )
    if config.reshard_after_forward is None:
        # fully_shard's own default: the root's parameters are needed right away by backward.
        fully_shard(
            model,
            mesh=mesh,
            mp_policy=policy,
            offload_policy=offload,
            ignored_params=ignored or None,
        )
    else:
        fully_shard(
            model,
            mesh=mesh,
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=policy,
            offload_policy=offload,
            ignored_params=ignored or None,
        )
    return model
