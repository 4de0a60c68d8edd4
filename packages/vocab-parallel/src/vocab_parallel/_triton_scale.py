# mypy: disable-error-code="no-untyped-def"
"""A Triton kernel that scales a gradient by the loss's upstream gradient, without a host sync.

A fixed grid strides over the tensor and reads the scale on the device, so a scale of exactly 1
(the usual case: the loss is the graph's output) costs one launch and touches nothing.
Imported lazily, like :mod:`vocab_parallel._triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from vocab_parallel._triton import on_device

__all__ = ["scale_"]


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    # x *= scale for a contiguous 16- or 32-bit tensor and an fp32 scalar held on the device,
    # in fp32 then rounded (as mul_ computes it, which for a bf16 tensor times an fp32 0-dim
    # tensor runs PyTorch's unvectorized mixed-dtype kernel). A fixed grid strides over the
    # tensor, so a scale of exactly 1 (nothing to do) ends every program at once: the pass
    # then costs a launch, not a read and a write, and the host never reads the scale.
    scale = tl.load(scale_ptr)
    stop = tl.where(scale != 1.0, n, 0)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, stop, step):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(x_ptr + offsets, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


# Programs of the grid-stride scaling kernel per SM: enough loads in flight to run at memory
# bandwidth, few enough that an early exit is free.
_SCALE_PROGRAMS_PER_SM = 8


def scale_(x: Tensor, scale: Tensor, *, max_programs: int | None = None) -> None:
    """Multiply x by scale in place, without a host sync (nothing is touched when it is 1).

    Args:
        x: contiguous float tensor of any shape (modified).
        scale: one-element fp32 tensor on x's device.
        max_programs: cap on the grid (default: a few per SM on CUDA); tests set a small one
            so that each program strides over several blocks.
    """
    n = x.numel()
    if n == 0:
        return
    block = 4096
    programs = triton.cdiv(n, block)
    if max_programs is None and x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        max_programs = _SCALE_PROGRAMS_PER_SM * sms
    if max_programs is not None:
        programs = max(1, min(programs, max_programs))
    with on_device(x):
        _scale_kernel[(programs,)](x, scale, n, BLOCK=block, num_warps=4)
