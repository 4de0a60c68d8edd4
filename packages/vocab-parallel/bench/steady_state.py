"""Fused linear losses back to back against the same calls spaced out (CUDA only).

A profiled T=16384 step of the grads-in-forward loss showed 96 ms of GPU work, while the
median between synchronised calls in bench/log_probs.py was 105 ms. This separates the
candidates: per call it records the wall time between synchronisations and the GPU time
between CUDA events around the call, once with the calls back to back and once with a pause
between them (a GPU that lowers its clocks under sustained load runs the spaced calls faster).
Ours and Liger-Kernel's fused linear cross-entropy are measured alike, alternating.

    python packages/vocab-parallel/bench/steady_state.py --tokens 16384 --out steady.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _measure import run_info

import vocab_parallel as vp
from train_testing.bench import write_json


def _calls(
    fn: Callable[[], None], *, count: int, pause_s: float
) -> tuple[list[float], list[float]]:
    """(wall ms, GPU ms) of ``count`` synchronised calls with ``pause_s`` between them."""
    wall, gpu = [], []
    for _ in range(count):
        if pause_s:
            time.sleep(pause_s)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        gpu.append(start.elapsed_time(stop))
    return wall, gpu


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between spaced calls")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("steady_state.py measures CUDA clocks; run it on a GPU machine")
    device = torch.device("cuda")
    torch.manual_seed(0)
    t, v, h = args.tokens, args.vocab, args.hidden
    hidden = torch.randn(t, h, device=device, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device=device, dtype=torch.bfloat16) / h**0.5).requires_grad_()
    labels = torch.randint(0, v, (t,), device=device)

    def step(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            hidden.grad = weight.grad = None
            loss_fn().backward()

        return run

    forms = {
        "ours fast (default chunks)": step(
            lambda: vp.linear_cross_entropy(
                hidden, weight, labels, reduction="sum", fp32_weight_grad=False
            )
        ),
        "ours fp32 weight-grad sum": step(
            lambda: vp.linear_cross_entropy(hidden, weight, labels, reduction="sum")
        ),
    }
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        forms["liger fused linear CE"] = step(
            lambda: liger_fused_linear_cross_entropy(hidden, weight, labels, reduction="sum")
        )
    except ImportError:
        pass
    for fn in forms.values():  # compile and warm the allocator
        fn()
    rows = []
    for pause in (0.0, args.pause):
        walls: dict[str, list[float]] = {name: [] for name in forms}
        gpus: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(2):
            for name, fn in forms.items():
                wall, gpu = _calls(fn, count=args.count // 2, pause_s=pause)
                walls[name] += wall
                gpus[name] += gpu
        for name in forms:
            rows.append(
                {
                    "form": name,
                    "pause_s": pause,
                    "wall_ms": statistics.median(walls[name]),
                    "gpu_ms": statistics.median(gpus[name]),
                    "gpu_min_ms": min(gpus[name]),
                }
            )
    for row in rows:
        print(
            f"{row['form']:<30} pause {row['pause_s']:.1f} s  wall {row['wall_ms']:7.2f} ms  "
            f"gpu {row['gpu_ms']:7.2f} ms (min {row['gpu_min_ms']:.2f})"
        )
    report: dict[str, object] = {
        **run_info(device),
        "tokens": t,
        "vocab": v,
        "hidden": h,
        "rows": rows,
    }
    if args.out is not None:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
