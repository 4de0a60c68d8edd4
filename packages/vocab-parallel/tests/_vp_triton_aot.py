"""Compile the Triton kernels for a CUDA target (sm_90) without a GPU; run as a script.

The CPU interpreter checks the kernels' arithmetic but not that they compile; this checks
that they lower to a cubin for every dtype and flag combination the library launches.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vocab_parallel import _triton as kernels
from vocab_parallel import _triton_scale

TARGET = GPUTarget("cuda", 90, 32)
# The row kernels' shared compile-time constants (BLOCK: the largest block the library launches).
ROW_CONSTEXPRS = {"LOG_FLOOR": kernels.LOG_FLOOR, "BLOCK": kernels._MAX_BLOCK}


def _compile(
    kernel: object, arguments: dict[str, str], constexprs: dict[str, object], *, num_warps: int
) -> None:
    """Compile ``kernel`` for TARGET; the signature is ``arguments`` plus the constexprs."""
    signature = {**arguments, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def _rows(dtype: str) -> dict[str, str]:
    """The arguments every row kernel starts with: the input and its (slab, row) addressing."""
    return {"x_ptr": dtype, "stride_slab": "i64", "stride_row": "i64", "rows_per_slab": "i64"}


def main() -> None:
    for dtype in ("*bf16", "*fp16", "*fp32"):
        for entropy, sum_z in ((True, True), (False, False)):
            arguments = {
                **_rows(dtype),
                "n_cols": "i32",
                "inv_t": "fp32",
                "max_ptr": "*fp32",
                "sum_exp_ptr": "*fp32",
                "sum_exp_z_ptr": "*fp32",
                "sum_z_ptr": "*fp32",
            }
            flags = {"WANT_ENTROPY": entropy, "WANT_SUM_Z": sum_z}
            _compile(kernels._stats_kernel, arguments, {**flags, **ROW_CONSTEXPRS}, num_warps=4)
    # The gradient kernel: in the logits' dtype, and fp32 logits into a 16-bit gradient (the
    # fused linear loss's exact mode).
    grad_dtypes = [(d, d) for d in ("*bf16", "*fp16", "*fp32")] + [
        ("*fp32", "*bf16"),
        ("*fp32", "*fp16"),
    ]
    for dtype, grad_dtype in grad_dtypes:
        for has_target, has_entropy, has_uniform in ((True, True, True), (True, False, False)):
            arguments = {
                **_rows(dtype),
                "g_ptr": grad_dtype,
                "g_stride_slab": "i64",
                "g_stride_row": "i64",
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
            }
            flags = {
                "HAS_TARGET": has_target,
                "HAS_ENTROPY": has_entropy,
                "HAS_UNIFORM": has_uniform,
            }
            _compile(kernels._grad_kernel, arguments, {**flags, **ROW_CONSTEXPRS}, num_warps=4)
    # The grads-in-forward losses' one-kernel step (a linear chunk, or in-place logits).
    for dtype in ("*bf16", "*fp16", "*fp32"):
        arguments = {
            **_rows(dtype),
            "n_cols": "i32",
            "inv_t": "fp32",
            "labels_ptr": "*i64",
            "ignore_index": "i64",
            "coef_ptr": "*fp32",
            "coef_stride": "i64",
            "log_p_ptr": "*fp32",
        }
        _compile(kernels._loss_grad_kernel, arguments, {"BLOCK": kernels._MAX_BLOCK}, num_warps=4)
        # Backward's scaling of the stored gradients by the upstream gradient.
        arguments = {"x_ptr": dtype, "scale_ptr": "*fp32", "n": "i64"}
        _compile(_triton_scale._scale_kernel, arguments, {"BLOCK": 4096}, num_warps=4)
    print("ok")


if __name__ == "__main__":
    main()
