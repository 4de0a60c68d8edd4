"""Kernel-level times of the fused linear log-prob pieces against cuBLAS, per tile configuration.

    python packages/vocab-parallel/bench/linear_tiles.py --tokens 8192 --vocab 151936 --hidden 4096

For the forward, one Triton kernel (logits tiles + softmax statistics in the epilogue) against
the cuBLAS matmul alone and against cuBLAS + the Triton statistics kernel; for one backward
block of ``--block-rows`` vocabulary rows, the Triton kernel that recomputes the block and
writes its logits gradient against cuBLAS + the Triton gradient kernel; and the two ways to
add a block's hidden gradient into the fp32 accumulator. A configuration is
BM,BN,BK,GROUP_M,stages,warps. Medians of CUDA-event timings after warm-up, one run.
``--quick`` runs tiny sizes in Triton's interpreter on CPU (CI keeps the script working; those
times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

DEFAULT_CONFIGS = [
    "128,256,64,8,3,8",
    "128,256,64,8,4,8",
    "128,128,64,8,4,4",
    "128,128,64,8,4,8",
    "256,128,64,8,3,8",
    "64,256,64,8,4,4",
]


def _time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        return float("nan")
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--block-rows", type=int, default=16384)
    parser.add_argument("--configs", default=";".join(DEFAULT_CONFIGS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, CPU interpreter")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.tokens, args.vocab, args.hidden, args.block_rows = 48, 200, 32, 64
        args.repeats, args.warmup, args.configs = 1, 1, "16,32,16,2,1,1"
    # Imported after TRITON_INTERPRET is settled: triton reads it when kernels are defined.
    from vocab_parallel import _triton, _triton_linear

    device = torch.device("cpu" if args.quick else "cuda")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    n, v, h = args.tokens, args.vocab, args.hidden
    hidden = torch.randn(n, h, device=device, dtype=dtype)
    weight = torch.randn(v, h, device=device, dtype=dtype) / h**0.5
    target_col = torch.randint(0, v, (n,), device=device)
    rows = weight[: args.block_rows]
    log_z = torch.randn(n, device=device) + 12.0
    g_all = torch.randn(n, device=device)
    block_grad = torch.empty(n, rows.shape[0], device=device, dtype=dtype)
    accumulator = torch.zeros(n, h, device=device)

    def timed(fn: Callable[[], object]) -> float:
        return _time_ms(fn, device, args.warmup, args.repeats)

    results: dict[str, float] = {
        "cublas forward matmul [N, V]": timed(lambda: hidden @ weight.T),
        "cublas matmul + triton stats": timed(
            lambda: _triton.shard_stats(
                hidden @ weight.T, inv_temperature=1.0, entropy=False, sum_z=False
            )
        ),
        "cublas block matmul [N, Vb]": timed(lambda: hidden @ rows.T),
        "cublas block matmul + triton grad": timed(
            lambda: _triton.logits_grad(
                hidden @ rows.T,
                inv_temperature=1.0,
                inv_vocab=1.0 / v,
                log_normalizer=log_z,
                entropy=None,
                grad_all=g_all,
                grad_entropy=None,
                grad_uniform=None,
                target_index=target_col.clamp(max=rows.shape[0] - 1),
                target_grad=g_all,
            )
        ),
        "accumulate: add_(mm)": timed(lambda: accumulator.add_(block_grad @ rows)),
    }
    if device.type == "cuda":
        results["accumulate: addmm out_dtype"] = timed(
            lambda: torch.addmm(
                accumulator, block_grad, rows, out_dtype=torch.float32, out=accumulator
            )
        )
    for text in args.configs.split(";"):
        bm, bn, bk, gm, stages, warps = (int(x) for x in text.split(","))
        cfg = _triton_linear.TileConfig(
            block_m=bm, block_n=bn, block_k=bk, group_m=gm, stages=stages, warps=warps
        )
        try:
            results[f"triton forward {text}"] = timed(
                lambda cfg=cfg: _triton_linear.linear_stats(
                    hidden, weight, target_col=target_col, inv_temperature=1.0, config=cfg
                )
            )
            results[f"triton block grad {text}"] = timed(
                lambda cfg=cfg: _triton_linear.linear_logits_grad(
                    hidden,
                    rows,
                    out=block_grad,
                    col_offset=0,
                    inv_temperature=1.0,
                    log_normalizer=log_z,
                    grad_all=g_all,
                    target_col=target_col,
                    target_grad=g_all,
                    config=cfg,
                )
            )
        except Exception as err:  # a tile that does not fit (shared memory) is reported, not fatal
            results[f"triton {text} failed: {type(err).__name__}"] = float("nan")
    flops = 2 * n * v * h
    block_flops = 2 * n * rows.shape[0] * h
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(f"N={n} V={v} H={h} block={rows.shape[0]} bf16 on {name}")
    for key, ms in results.items():
        work = flops if "forward" in key else block_flops
        tflops = work / (ms / 1e3) / 1e12 if ms == ms and ms > 0 else float("nan")
        print(f"{key:<44}{ms:>10.3f} ms{tflops:>9.1f} TFLOP/s")
    if args.out is not None:
        report = {"device_name": name, "tokens": n, "vocab": v, "hidden": h}
        report.update(block_rows=rows.shape[0], torch=torch.__version__, ms=results)
        args.out.write_text(json.dumps(report, indent=2))
    return results


if __name__ == "__main__":
    main()
