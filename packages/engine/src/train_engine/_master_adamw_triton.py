# mypy: disable-error-code="no-untyped-def"
"""The Triton kernel of :class:`~train_engine.MasterWeightAdamW`: one launch per tensor bucket.

A bucket is the tensors of one parameter group that share a parameter dtype and a gradient
dtype. The kernel walks a block table (which tensor, which offset) and reaches each tensor
through tables of addresses, so parameters and gradients stay where autograd and the model
put them: nothing is flattened or copied. Per element it reads the gradient (its own dtype),
the fp32 master weight and both fp32 moments, and writes the master, the moments and the
rounded parameter: 28 bytes for a bf16 parameter with a bf16 gradient.

Imported only when a CUDA (or interpreted) update runs, so the engine needs no Triton otherwise.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["BLOCK", "launch_master_adamw"]

#: Elements per program: 8 per thread on 4 warps, 16-byte loads of bf16 gradients.
BLOCK = 1024
_WARPS = 4


@triton.jit
def _update_block(
    offsets,
    numel,
    param_ptr,
    grad_ptr,
    master_ptr,
    avg_ptr,
    sq_ptr,
    step,
    grad_scale_ptr,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    PARAM_DTYPE: tl.constexpr,
    SEPARATE_MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    FULL: tl.constexpr,
):
    """One block's update; FULL: every offset is in range (no mask, so vector accesses)."""
    if FULL:
        grad = tl.load(grad_ptr + offsets).to(tl.float32)
        weight = tl.load(master_ptr + offsets)
        avg = tl.load(avg_ptr + offsets)
        sq = tl.load(sq_ptr + offsets)
    else:
        mask = offsets < numel
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        weight = tl.load(master_ptr + offsets, mask=mask, other=0.0)
        avg = tl.load(avg_ptr + offsets, mask=mask, other=0.0)
        sq = tl.load(sq_ptr + offsets, mask=mask, other=0.0)
    if HAS_GRAD_SCALE:
        grad = grad / tl.load(grad_scale_ptr)

    # torch.optim.AdamW's order: decoupled decay, the moments, then the bias-corrected step.
    weight = weight * (1.0 - lr * weight_decay)
    avg = avg + (1.0 - beta1) * (grad - avg)
    sq = beta2 * sq + (1.0 - beta2) * grad * grad
    # beta ** step as exp2(step * log2(beta)): exact to fp32 rounding, and 0 for beta = 0.
    correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    correction2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    denom = tl.sqrt(sq) / tl.sqrt(correction2) + eps
    weight = weight - (lr / correction1) * avg / denom
    rounded = weight.to(PARAM_DTYPE, fp_downcast_rounding="rtne")

    if FULL:
        tl.store(master_ptr + offsets, weight)
        tl.store(avg_ptr + offsets, avg)
        tl.store(sq_ptr + offsets, sq)
        if SEPARATE_MASTER:
            tl.store(param_ptr + offsets, rounded)
    else:
        tl.store(master_ptr + offsets, weight, mask=mask)
        tl.store(avg_ptr + offsets, avg, mask=mask)
        tl.store(sq_ptr + offsets, sq, mask=mask)
        if SEPARATE_MASTER:
            tl.store(param_ptr + offsets, rounded, mask=mask)


@triton.jit
def _master_adamw_kernel(
    block_tensor_ptr,
    block_offset_ptr,
    numel_ptr,
    param_addr_ptr,
    grad_addr_ptr,
    master_addr_ptr,
    avg_addr_ptr,
    sq_addr_ptr,
    step_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    SEPARATE_MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    block = tl.program_id(0)
    tensor = tl.load(block_tensor_ptr + block)
    start = tl.multiple_of(tl.load(block_offset_ptr + block), BLOCK_SIZE)
    offsets = start + tl.arange(0, BLOCK_SIZE)
    numel = tl.load(numel_ptr + tensor)
    if HAS_FOUND_INF:
        # A skipped update reads and writes nothing (fully masked loads fetch no memory).
        numel = tl.where(tl.load(found_inf_ptr) == 0, numel, 0)
    param_ptr = tl.load(param_addr_ptr + tensor).to(tl.pointer_type(PARAM_DTYPE))
    grad_ptr = tl.load(grad_addr_ptr + tensor).to(tl.pointer_type(GRAD_DTYPE))
    master_ptr = tl.load(master_addr_ptr + tensor).to(tl.pointer_type(tl.float32))
    avg_ptr = tl.load(avg_addr_ptr + tensor).to(tl.pointer_type(tl.float32))
    sq_ptr = tl.load(sq_addr_ptr + tensor).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        # Addresses read from a table carry no alignment the compiler can see; the host checked
        # that every one is 16-byte aligned, which lets full blocks use vector accesses.
        param_ptr = tl.multiple_of(param_ptr, 16)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
        master_ptr = tl.multiple_of(master_ptr, 16)
        avg_ptr = tl.multiple_of(avg_ptr, 16)
        sq_ptr = tl.multiple_of(sq_ptr, 16)
    step = tl.load(step_ptr + tensor) + 1.0
    if start + BLOCK_SIZE <= numel:
        _update_block(
            offsets,
            numel,
            param_ptr,
            grad_ptr,
            master_ptr,
            avg_ptr,
            sq_ptr,
            step,
            grad_scale_ptr,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            PARAM_DTYPE,
            SEPARATE_MASTER,
            HAS_GRAD_SCALE,
            True,
        )
    else:
        _update_block(
            offsets,
            numel,
            param_ptr,
            grad_ptr,
            master_ptr,
            avg_ptr,
            sq_ptr,
            step,
            grad_scale_ptr,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            PARAM_DTYPE,
            SEPARATE_MASTER,
            HAS_GRAD_SCALE,
            False,
        )


def _triton_dtype(dtype_name: str) -> tl.dtype:
    return {"float32": tl.float32, "bfloat16": tl.bfloat16, "float16": tl.float16}[dtype_name]


def launch_master_adamw(
    *,
    block_tensor: Tensor,
    block_offset: Tensor,
    numels: Tensor,
    addresses: Tensor,
    steps: Tensor,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    param_dtype: str,
    grad_dtype: str,
    separate_master: bool,
    aligned: bool,
) -> None:
    """Update one bucket in place.

    Args:
        block_tensor: int32 [blocks], the bucket-local tensor index of each block.
        block_offset: int64 [blocks], the block's first element within its tensor.
        numels: int64 [tensors], each tensor's element count.
        addresses: int64 [5, tensors], the data addresses of the parameters, gradients, master
            weights, first and second moments (row 2 repeats row 0 for fp32 parameters).
        steps: float32 [tensors], each tensor's completed steps (read, not incremented).
        grad_scale: 0-dim float32, every gradient is divided by it; None for 1.
        found_inf: 0-dim float32, a nonzero value makes the launch a no-op; None for 0.
        lr: the group's learning rate.
        beta1: the first moment's decay.
        beta2: the second moment's decay.
        eps: added to the root of the second moment.
        weight_decay: the group's decoupled decay.
        param_dtype: the parameters' dtype, "float32", "bfloat16" or "float16".
        grad_dtype: the gradients' dtype, one of the same.
        separate_master: the master weight is its own fp32 tensor (low-precision parameter).
        aligned: every address in ``addresses`` is a multiple of 16 bytes (vector accesses).
    """
    blocks = block_tensor.numel()
    if blocks == 0:
        return
    # An absent scale/flag still needs a valid pointer; the constexpr flags keep it unread.
    _master_adamw_kernel[(blocks,)](
        block_tensor,
        block_offset,
        numels,
        addresses[0],
        addresses[1],
        addresses[2],
        addresses[3],
        addresses[4],
        steps,
        steps if grad_scale is None else grad_scale,
        steps if found_inf is None else found_inf,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        PARAM_DTYPE=_triton_dtype(param_dtype),
        GRAD_DTYPE=_triton_dtype(grad_dtype),
        SEPARATE_MASTER=separate_master,
        HAS_GRAD_SCALE=grad_scale is not None,
        HAS_FOUND_INF=found_inf is not None,
        ALIGNED=aligned,
        BLOCK_SIZE=BLOCK,
        num_warps=_WARPS,
    )
