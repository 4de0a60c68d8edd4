"""Launch configurations of the one-row loss-and-gradient kernel, side by side (CUDA only).

`vocab_parallel._triton._loss_grad_kernel` runs in `cross_entropy(..., in_place=True)` over
all logits and in the grads-in-forward linear loss over each chunk. Its cost is memory
traffic: one read of the row for the softmax normalizer, a second read and a write for the
gradient. The second read is cheap when the row is still in L2, which depends on how many
rows are in flight (programs per SM: BLOCK and num_warps). This times the kernel alone over
[T, V] bf16 logits for a grid of (BLOCK, num_warps), and the full forward+backward of our
in-place cross-entropy and Liger-Kernel's, all in one process, each a median of synchronised
calls.

    python packages/vocab-parallel/bench/loss_grad_configs.py --tokens 16384 --out cfg.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from _measure import run_info

import vocab_parallel as vp
from train_testing.bench import write_json
from train_testing.bench.runtime import times_ms
from vocab_parallel import _triton

CONFIGS = [(4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32)]


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--profile", action="store_true", help="kernel tables and idle gaps of the full forms"
    )
    parser.add_argument("--skip-configs", action="store_true", help="only the full forms")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("loss_grad_configs.py times CUDA kernels; run it on a GPU machine")
    device = torch.device("cuda")
    t, v = args.tokens, args.vocab
    torch.manual_seed(0)
    logits = torch.randn(t, v, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, v, (t,), device=device)
    log_p = torch.empty(t, device=device, dtype=torch.float32)
    scale = torch.full((t,), -1.0, device=device)
    nbytes = logits.numel() * logits.element_size()

    def median(fn: object) -> float:
        return statistics.median(times_ms(fn, device, warmup=3, iters=args.repeats))  # type: ignore[arg-type]

    rows: list[dict[str, object]] = []
    for block, warps in [] if args.skip_configs else CONFIGS:

        def kernel(block: int = block, warps: int = warps) -> None:
            _triton._loss_grad_kernel[(t,)](
                logits, 0, logits.stride(0), t, v, 1.0, labels, -100, scale, 1, log_p,
                BLOCK=block, num_warps=warps,
            )  # fmt: skip

        ms = median(kernel)
        rows.append({"form": f"kernel BLOCK={block} warps={warps}", "ms": ms,
                     "TB/s (3 passes)": 3 * nbytes / ms / 1e9})  # fmt: skip

    # The out-of-place form's two kernels: statistics (one read) and gradient (read + write).
    stats = torch.empty(4, t, device=device, dtype=torch.float32)
    grad = torch.empty_like(logits)
    for block, warps in [] if args.skip_configs else CONFIGS:

        def two_kernels(block: int = block, warps: int = warps) -> None:
            _triton._stats_kernel[(t,)](
                logits, 0, logits.stride(0), t, v, 1.0, stats[0], stats[1], stats[2], stats[3],
                WANT_ENTROPY=False, WANT_SUM_Z=False, LOG_FLOOR=_triton.LOG_FLOOR,
                BLOCK=block, num_warps=warps,
            )  # fmt: skip
            _triton._grad_kernel[(t,)](
                logits, 0, logits.stride(0), t, grad, 0, grad.stride(0), v, 1.0, 1.0 / v,
                stats[1], stats[2], scale, scale, scale, labels, scale,
                HAS_TARGET=True, HAS_ENTROPY=False, HAS_UNIFORM=False,
                LOG_FLOOR=_triton.LOG_FLOOR, BLOCK=block, num_warps=warps,
            )  # fmt: skip

        ms = median(two_kernels)
        rows.append({"form": f"stats+grad kernels BLOCK={block} warps={warps}", "ms": ms,
                     "TB/s (3 passes)": 3 * nbytes / ms / 1e9})  # fmt: skip

    buffer = logits.clone().requires_grad_()

    def step(fn: object) -> None:
        buffer.grad = None
        fn(buffer).backward()  # type: ignore[operator]

    forms = {
        "ours cross_entropy in_place (grad in forward)": lambda x: vp.cross_entropy(
            x, labels, reduction="sum", in_place=True
        ),
        "ours cross_entropy out of place": lambda x: vp.cross_entropy(x, labels, reduction="sum"),
    }
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        forms["liger cross_entropy"] = lambda x: liger_cross_entropy(x, labels, reduction="sum")
    except ImportError:
        pass
    # Alternate the full forms so that clock or thermal drift spreads over all of them alike.
    timings: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(3):
        for name, fn in forms.items():
            timings[name].append(median(lambda fn=fn: step(fn)))
    for name, values in timings.items():
        ms = statistics.median(values)
        rows.append({"form": name, "ms": ms, "TB/s (3 passes)": 3 * nbytes / ms / 1e9})
    if args.profile:
        _profile(forms, step, device)
    for row in rows:
        print(f"{row['form']:<52} {row['ms']:8.3f} ms  {row['TB/s (3 passes)']:6.2f} TB/s")
    report: dict[str, object] = {**run_info(device), "tokens": t, "vocab": v, "rows": rows}
    if args.out is not None:
        write_json(args.out, report)
    return report


def _profile(forms: dict[str, object], step: object, device: torch.device) -> None:
    """Kernel table and GPU timeline of three back-to-back synchronised calls of each form."""
    from fused_linear_ab import gpu_timeline  # this folder is on sys.path as the script's
    from torch.profiler import ProfilerActivity, profile

    for name, fn in forms.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(fn)  # type: ignore[operator]
                torch.cuda.synchronize(device)
        print(f"--- {name}: 3 calls")
        print(
            prof.key_averages().table(
                sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60
            )
        )
        print(json.dumps(gpu_timeline(prof, steps=3), indent=1), flush=True)


if __name__ == "__main__":
    main()
