"""Compile MasterWeightAdamW's Triton kernel for sm_90 without a GPU; run as a script.

The interpreter checks the kernel's arithmetic, not that it lowers (the address tables' int to
pointer casts, the dtype combinations): this compiles every combination the optimizer launches.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from train_engine import _master_adamw_triton as kernels

TARGET = GPUTarget("cuda", 90, 32)
ARGUMENTS = {
    "block_tensor_ptr": "*i32",
    "block_offset_ptr": "*i64",
    "numel_ptr": "*i64",
    "param_addr_ptr": "*i64",
    "grad_addr_ptr": "*i64",
    "master_addr_ptr": "*i64",
    "avg_addr_ptr": "*i64",
    "sq_addr_ptr": "*i64",
    "step_ptr": "*fp32",
    "grad_scale_ptr": "*fp32",
    "found_inf_ptr": "*fp32",
    "lr": "fp32",
    "beta1": "fp32",
    "beta2": "fp32",
    "eps": "fp32",
    "weight_decay": "fp32",
}


def main() -> None:
    low = (tl.bfloat16, tl.float16)
    # (parameter, gradient, separate master): low-precision parameters with a gradient of
    # their dtype or fp32 (an fp32 reduction), and fp32 parameters (their own master).
    combos = [(p, g, True) for p in low for g in (p, tl.float32)] + [
        (tl.float32, tl.float32, False)
    ]
    for param_dtype, grad_dtype, separate in combos:
        for flags in ((True, True, True), (False, False, False)):
            constexprs = {
                "PARAM_DTYPE": param_dtype,
                "GRAD_DTYPE": grad_dtype,
                "SEPARATE_MASTER": separate,
                "HAS_GRAD_SCALE": flags[0],
                "HAS_FOUND_INF": flags[1],
                "ALIGNED": flags[2],
                "BLOCK_SIZE": kernels.BLOCK,
            }
            signature = {**ARGUMENTS, **dict.fromkeys(constexprs, "constexpr")}
            src = ASTSource(
                fn=kernels._master_adamw_kernel, signature=signature, constexprs=constexprs
            )
            triton.compile(src, target=TARGET, options={"num_warps": kernels._WARPS})
    print("ok")


if __name__ == "__main__":
    main()
