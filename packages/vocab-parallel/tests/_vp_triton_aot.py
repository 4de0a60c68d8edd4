"""Compile the Triton kernels for a CUDA target (sm_90) without a GPU; run as a script.

The CPU interpreter checks the kernels' arithmetic but not that they compile; this checks
that they lower to a cubin for every dtype and flag combination the library launches.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vocab_parallel import _triton as kernels
from vocab_parallel import _triton_linear as linear

TARGET = GPUTarget("cuda", 90, 32)


def main() -> None:
    for dtype in ("*bf16", "*fp16", "*fp32"):
        for entropy, sum_z in ((True, True), (False, False)):
            signature = {
                "x_ptr": dtype,
                "stride_slab": "i64",
                "stride_row": "i64",
                "rows_per_slab": "i64",
                "n_cols": "i32",
                "inv_t": "fp32",
                "max_ptr": "*fp32",
                "sum_exp_ptr": "*fp32",
                "sum_exp_z_ptr": "*fp32",
                "sum_z_ptr": "*fp32",
                "WANT_ENTROPY": "constexpr",
                "WANT_SUM_Z": "constexpr",
                "LOG_FLOOR": "constexpr",
                "BLOCK": "constexpr",
            }
            constants = {
                "WANT_ENTROPY": entropy,
                "WANT_SUM_Z": sum_z,
                "LOG_FLOOR": kernels._LOG_FLOOR,
                "BLOCK": 8192,
            }
            src = ASTSource(fn=kernels._stats_kernel, signature=signature, constexprs=constants)
            triton.compile(src, target=TARGET, options={"num_warps": 8})
        for has_target, has_entropy, has_uniform in ((True, True, True), (True, False, False)):
            signature = {
                "x_ptr": dtype,
                "stride_slab": "i64",
                "stride_row": "i64",
                "rows_per_slab": "i64",
                "g_ptr": dtype,
                "n_cols": "i32",
                "inv_t": "fp32",
                "inv_vocab": "fp32",
                "log_z_ptr": "*fp32",
                "entropy_ptr": "*fp32",
                "g_all_ptr": "*fp32",
                "g_entropy_ptr": "*fp32",
                "g_uniform_ptr": "*fp32",
                "target_col_ptr": "*i64",
                "g_target_ptr": "*fp32",
                "HAS_TARGET": "constexpr",
                "HAS_ENTROPY": "constexpr",
                "HAS_UNIFORM": "constexpr",
                "LOG_FLOOR": "constexpr",
                "BLOCK": "constexpr",
            }
            constants = {
                "HAS_TARGET": has_target,
                "HAS_ENTROPY": has_entropy,
                "HAS_UNIFORM": has_uniform,
                "LOG_FLOOR": kernels._LOG_FLOOR,
                "BLOCK": 8192,
            }
            src = ASTSource(fn=kernels._grad_kernel, signature=signature, constexprs=constants)
            triton.compile(src, target=TARGET, options={"num_warps": 8})
    compile_linear_kernels()
    print("ok")


def compile_linear_kernels() -> None:
    """The matmul-epilogue kernels of the fused linear form, at their default tiles."""
    shared = {
        "h_ptr": "",
        "w_ptr": "",
        "n_rows": "i32",
        "n_cols": "i32",
        "k_dim": "i32",
        "stride_h": "i64",
        "stride_w": "i64",
        "inv_t": "fp32",
    }
    outputs = {
        "_stats_kernel": {
            "target_col_ptr": "*i64",
            "part_max_ptr": "*fp32",
            "part_sum_ptr": "*fp32",
            "target_ptr": "*fp32",
        },
        "_grad_kernel": {
            "out_ptr": "",
            "log_z_ptr": "*fp32",
            "g_all_ptr": "*fp32",
            "target_col_ptr": "*i64",
            "target_grad_ptr": "*fp32",
            "col_offset": "i32",
        },
    }
    for name, config in (
        ("_stats_kernel", linear.FORWARD_CONFIG),
        ("_grad_kernel", linear.BACKWARD_CONFIG),
    ):
        fn = getattr(linear, name)
        for dtype in ("*bf16", "*fp16"):
            for even_k in (True, False):
                types = {**shared, **outputs[name]}
                # The kernel's own argument order; 16-bit pointers take the dtype under test.
                signature = {
                    arg: (types[arg] or dtype) if arg in types else "constexpr"
                    for arg in fn.arg_names
                }
                constants = {
                    "BM": config.block_m,
                    "BN": config.block_n,
                    "BK": config.block_k,
                    "GROUP_M": config.group_m,
                    "EVEN_K": even_k,
                    "UPCAST": False,
                }
                src = ASTSource(fn=fn, signature=signature, constexprs=constants)
                triton.compile(
                    src,
                    target=TARGET,
                    options={"num_warps": config.warps, "num_stages": config.stages},
                )


if __name__ == "__main__":
    main()
