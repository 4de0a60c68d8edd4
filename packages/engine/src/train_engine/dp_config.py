"""The data-parallel wrappers' settings: :class:`DDPConfig` and :class:`FSDP2Config`.

Plain dataclasses with no torch import, so a YAML config that holds them (train-recipes') is
read and rejected before torch is imported; :func:`train_engine.apply_data_parallel` applies
them. ``torch.dtype`` appears in annotations only (``typing.get_type_hints`` needs ``torch`` in
``localns`` to resolve them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

__all__ = ["DDPConfig", "DTypeName", "FSDP2Config"]


#: Dtypes by name, as a YAML config spells them (torchtitan's convention); resolved at use.
DTypeName = Literal["float32", "bfloat16", "float16"]


@dataclass(kw_only=True, slots=True, frozen=True)
class DDPConfig:
    """Arguments forwarded to ``torch.nn.parallel.DistributedDataParallel``.

    Attributes:
        broadcast_buffers: broadcast buffers from rank 0 at every forward; off by default
            because most LLMs have no buffers that change.
        find_unused_parameters: traverse the autograd graph after each forward to find
            parameters that got no gradient (costly; only for models with conditional branches).
        static_graph: reuse the first iteration's graph; DDP does not support it together with
            gradient accumulation (``no_sync``), so it is rejected when accumulating.
        bucket_cap_mb: gradient bucket size in MiB; None keeps PyTorch's default (25).
        gradient_as_bucket_view: ``p.grad`` aliases DDP's flat buckets (saves one gradient copy;
            clipping then works in place on bucket memory).
    """

    broadcast_buffers: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class FSDP2Config:
    """Arguments for ``torch.distributed.fsdp.fully_shard``, applied per block and at the root.

    Dtypes may be given by name ("bfloat16", resolved when the model is wrapped), so a config
    read from YAML holds no torch objects; a ``torch.dtype`` is accepted as well.

    Attributes:
        reshard_after_forward: None keeps the usual choice (reshard every block but the last,
            whose parameters backward needs at once); True/False (or an int group size) for all.
            False is ZeRO-2-like: more memory, no all-gather in backward.
        param_dtype: dtype of unsharded parameters in forward/backward (e.g. "bfloat16");
            None keeps the parameter dtype (no mixed precision).
        reduce_dtype: dtype of the gradient reduce-scatter (e.g. "float32"); None follows
            ``param_dtype``.
        output_dtype: dtype forward outputs are cast to; None leaves them.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU.
    """

    reshard_after_forward: bool | int | None = None
    param_dtype: DTypeName | torch.dtype | None = None
    reduce_dtype: DTypeName | torch.dtype | None = None
    output_dtype: DTypeName | torch.dtype | None = None
    cast_forward_inputs: bool = True
    cpu_offload: bool = False
