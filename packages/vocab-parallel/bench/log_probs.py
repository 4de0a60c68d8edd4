"""Forward+backward time and peak extra memory of token log-prob implementations, side by side.

    python packages/vocab-parallel/bench/log_probs.py --device cuda --tokens 8192 --vocab 151936

Variants (all compute log p(label) for T tokens over V entries and backpropagate):
    naive            log_softmax(logits.float()).gather(...)          (the baseline)
    naive_compiled   torch.compile of the same (CUDA only)
    ours             vocab_parallel.token_log_probs (backend "auto": Triton on CUDA, else torch)
    ours_torch       the pure-PyTorch chunked path (CUDA only; on CPU it is "ours")
    naive_linear     hidden @ weight.T, then naive                    (baseline of the fused form)
    fused_linear     vocab_parallel.linear_token_log_probs
    fused_linear_bN  fused_linear with N vocabulary rows per block (--linear-blocks, CUDA)
    four_matmuls     not an implementation: the four full-size cuBLAS matmuls that any exact
                     form under the memory bound must run (logits forward, logits again in
                     backward, hidden and weight gradients), with no softmax work at all; its
                     time is a lower bound for such forms (CUDA)

Peak extra memory (CUDA only) is the peak allocated during forward+backward above what was
allocated before (the inputs); it includes the gradients the call returns. The floor is the time
to move 3 x the bf16 logits (read forward, read backward, write gradient) at the copy bandwidth
measured on the same device. Prints one table, writes JSON with device name and versions.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import vocab_parallel as vp
from train_testing.bench import GIB, device_name, print_lines, sync, times_ms, versions, write_json


@dataclass(kw_only=True, slots=True)
class Row:
    variant: str
    baseline: str
    median_ms: float
    peak_extra_gib: float | None
    extra_over_logits: float | None
    grad_gib: float
    transient_over_logits: float | None
    speedup: float | None = None
    over_floor: float | None = None


def _time_ms(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    return statistics.median(times_ms(fn, device, warmup=warmup, iters=repeats))


def _peak_extra(
    fn: Callable[[], None], reset: Callable[[], None], device: torch.device
) -> float | None:
    if device.type != "cuda":
        return None
    reset()  # free the previous run's gradients, so that they count in this peak
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / GIB


def _copy_bandwidth(nbytes: int, device: torch.device, repeats: int) -> float:
    """Bytes per second of a device-local copy (read + write) of ``nbytes``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    ms = _time_ms(copy, device, warmup=2, repeats=repeats)
    return 2 * src.numel() * 2 / (ms / 1e3)


def naive_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096, help="H of the fused linear form")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke run)")
    parser.add_argument("--no-linear", action="store_true", help="skip the fused linear rows")
    parser.add_argument(
        "--linear-blocks",
        default="",
        help="comma-separated vocabulary rows per block: extra fused_linear_bN rows (CUDA)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: stdout only)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.hidden = 64, 1000, 32
        args.repeats, args.warmup = 2, 1

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    t, v, h = args.tokens, args.vocab, args.hidden
    logits = torch.randn(t, v, device=device, dtype=dtype).requires_grad_()
    labels = torch.randint(0, v, (t,), device=device)
    logits_bytes = logits.numel() * logits.element_size()

    # name -> (baseline, step, reset, leaves whose gradients the step returns)
    variants: dict[str, tuple[str, Callable[[], None], Callable[[], None], list]] = {}

    def clear_logits() -> None:
        logits.grad = None

    def logits_step(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            clear_logits()
            fn(logits, labels).sum().backward()

        return step

    def logits_variant(fn: Callable[..., torch.Tensor]) -> tuple:
        return ("naive", logits_step(fn), clear_logits, [logits])

    variants["naive"] = logits_variant(naive_log_probs)
    if device.type == "cuda":
        variants["naive_compiled"] = logits_variant(torch.compile(naive_log_probs, dynamic=False))
    variants["ours"] = logits_variant(lambda x, y: vp.token_log_probs(x, y))
    if device.type == "cuda":
        variants["ours_torch"] = logits_variant(
            lambda x, y: vp.token_log_probs(x, y, backend="torch")
        )

    if not args.no_linear:
        hidden = torch.randn(t, h, device=device, dtype=dtype).requires_grad_()
        weight = (torch.randn(v, h, device=device, dtype=dtype) / h**0.5).requires_grad_()

        def clear_linear() -> None:
            hidden.grad = weight.grad = None

        def linear_step(fused: bool, **options: object) -> Callable[[], None]:
            def step() -> None:
                clear_linear()
                if fused:
                    out = vp.linear_token_log_probs(hidden, weight, labels, **options)  # type: ignore[arg-type]
                else:
                    out = naive_log_probs(hidden @ weight.T, labels)
                out.sum().backward()

            return step

        leaves = [hidden, weight]
        variants["naive_linear"] = ("naive_linear", linear_step(False), clear_linear, leaves)
        variants["fused_linear"] = ("naive_linear", linear_step(True), clear_linear, leaves)
        if device.type == "cuda":
            for rows_text in filter(None, args.linear_blocks.split(",")):
                variants[f"fused_linear_b{int(rows_text)}"] = (
                    "naive_linear",
                    linear_step(True, chunk_size=int(rows_text)),
                    clear_linear,
                    leaves,
                )
            grad_logits = torch.randn(t, v, device=device, dtype=dtype) / v

            def four_matmuls() -> None:
                with torch.no_grad():
                    for _ in range(2):  # forward, and the recomputation in backward
                        hidden @ weight.T
                    grad_logits @ weight
                    grad_logits.T @ hidden

            variants["four_matmuls"] = ("naive_linear", four_matmuls, clear_linear, [])

    rows: dict[str, Row] = {}
    for name, (baseline, step, reset, grad_leaves) in variants.items():
        ms = _time_ms(step, device, args.warmup, args.repeats)
        peak = _peak_extra(step, reset, device)
        grad_bytes = sum(x.numel() * x.element_size() for x in grad_leaves)
        rows[name] = Row(
            variant=name,
            baseline=baseline,
            median_ms=ms,
            peak_extra_gib=peak,
            extra_over_logits=None if peak is None else peak * GIB / logits_bytes,
            grad_gib=grad_bytes / GIB,
            transient_over_logits=(
                None if peak is None else (peak * GIB - grad_bytes) / logits_bytes
            ),
        )
        reset()
    bandwidth = _copy_bandwidth(logits_bytes, device, args.repeats)
    floor_ms = 3 * logits_bytes / bandwidth * 1e3
    for row in rows.values():
        row.speedup = rows[row.baseline].median_ms / row.median_ms
        row.over_floor = row.median_ms / floor_ms

    header = (
        f"{'variant':<16}{'median ms':>11}{'peak extra GiB':>16}{'x logits':>10}"
        f"{'transient':>11}{'speedup':>9}{'x floor':>9}"
    )
    print(f"T={t} V={v} H={h} {args.dtype} on {device} ({device_name(device)})")
    print(
        f"logits {logits_bytes / GIB:.4g} GiB; floor {floor_ms:.4g} ms at "
        f"{bandwidth / 1e9:.3g} GB/s measured copy bandwidth (3 passes over the logits)"
    )
    print(header)
    for row in rows.values():
        peak = "-" if row.peak_extra_gib is None else f"{row.peak_extra_gib:.3f}"
        ratio = "-" if row.extra_over_logits is None else f"{row.extra_over_logits:.2f}"
        trans = "-" if row.transient_over_logits is None else f"{row.transient_over_logits:.2f}"
        print(
            f"{row.variant:<16}{row.median_ms:>11.3f}{peak:>16}{ratio:>10}{trans:>11}"
            f"{row.speedup:>8.2f}x{row.over_floor:>8.1f}x"
        )
    print(
        "speedup: vs the row's baseline (naive, or naive_linear for the fused form); "
        "x logits: peak extra / logits bytes; transient: the same without the returned "
        "gradients (x logits)"
    )

    report = {
        "device": str(device),
        "device_name": device_name(device),
        **versions(),
        "vocab_parallel": vp.__version__,
        "tokens": t,
        "vocab": v,
        "hidden": h,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "logits_gib": logits_bytes / GIB,
        "copy_bandwidth_gbps": bandwidth / 1e9,
        "floor_ms": floor_ms,
        "rows": [asdict(r) for r in rows.values()],
    }
    if args.out is not None:
        print_lines(f"wrote {write_json(args.out, report)}")
    return list(rows.values())


if __name__ == "__main__":
    main()
