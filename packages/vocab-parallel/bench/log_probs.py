"""Forward+backward time, peak extra memory and exactness of token-sum cross-entropy forms,
ours and their peers side by side in one process.

    python packages/vocab-parallel/bench/log_probs.py --device cuda --tokens 8192 --vocab 151936

Every variant computes the token-sum loss sum_t -log p(label_t) (every 16th label is
ignore_index; --ignore-every 2 ignores half, as an RL batch whose prompts are half its tokens)
for T tokens over V entries and backpropagates it.

On logits [T, V] (baseline: naive):
    naive             -log_softmax(logits.float()).gather(...).sum()
    naive_compiled    torch.compile of the same (CUDA only)
    ours              vocab_parallel.cross_entropy(reduction="sum") (Triton on CUDA, else torch)
    ours_torch        the pure-PyTorch chunked path (CUDA only; on CPU it is "ours")
    ours_in_place     ours with in_place=True: the gradient is written into the logits
    liger_ce          liger_kernel's cross-entropy (in place too; CUDA, optional import)
On hidden [T, H] and the projection weight [V, H] (baseline: naive_linear):
    naive_linear      hidden @ weight.T, then naive
    fused_linear      vocab_parallel.linear_token_log_probs (recomputes the logits in backward;
                      the ignored tokens are left out of its matmuls)
    fused_linear_all  the same with skip_ignored=False (every token through the matmuls)
    fused_linear_bN   the same with N vocabulary rows per block (--linear-blocks, CUDA)
    grads_in_forward  vocab_parallel.linear_cross_entropy(reduction="sum"): gradients formed
                      in forward (defaults: bf16 chunk logits, fp32 weight-gradient sum)
    grads_in_forward_fast   the same with fp32_weight_grad=False (summed in bf16)
    grads_in_forward_exact  the same with fp32_logits=True (fp32 chunk logits)
    grads_in_forward[_fast]_cN  with N tokens per chunk (--fused-chunks, CUDA)
    liger_fused_linear     liger_kernel's fused linear cross-entropy (CUDA, optional import)
    cce               cut_cross_entropy.linear_cross_entropy, its default gradient filtering
    cce_exact         the same with filter_eps=None (no filtering)
    three_matmuls / four_matmuls   not implementations: the three (logits, hidden and weight
                      gradients) or four (plus the recomputation) full-size cuBLAS matmuls with
                      no softmax work; lower bounds for the two fused designs (CUDA)

``--autocast`` runs the fused linear rows as an AMP loop calls them (HF Trainer's bf16, DDP with
autocast): hidden and weight are fp32 leaves holding the same bf16 values, and each forward runs
under ``torch.autocast`` in ``--dtype``; the matmuls still run in bf16, the leaves get fp32
gradients, and a gradient never rounded to bf16 can fall below the floor below. CCE's backward
asserts 16-bit embeddings, so its rows cast both operands to ``--dtype`` first, as a caller must.
A form that raises on its inputs becomes a row with status "failed: ..." (the run goes on).

Exactness: each variant's loss and gradients against an fp32 reference computed by plain
PyTorch from the same inputs (relative error, ||got - ref|| / ||ref||, the worst of its
gradients); "floor" is the error of the reference itself rounded to the input dtype, which no
gradient returned in that dtype can beat. Peak extra memory (CUDA only) is the peak allocated
during forward+backward above what was allocated before (the inputs); it includes the
gradients the call returns ("transient" excludes them; an in-place gradient takes no new
memory). The floor time is 3 passes over the bf16 logits at the measured copy bandwidth.
Peers that are not installed, or that need CUDA, appear as rows with that status and no
numbers. Prints one table, writes JSON with device name and versions.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch
from _measure import (
    GIB,
    Row,
    device_name,
    fp32_reference,
    measure,
    rounding_floor,
    run_info,
    time_ms,
)
from _variants import IGNORE, Variant, linear_variants, logits_variants, naive_loss

from train_testing.bench.runtime import add_device_argument


def _copy_bandwidth(nbytes: int, device: torch.device, repeats: int) -> float:
    """Bytes per second of a device-local copy (read + write) of ``nbytes``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    ms = time_ms(copy, device, warmup=2, repeats=repeats)
    return 2 * src.numel() * 2 / (ms / 1e3)


def _wanted(only: str) -> set[str]:
    return {name.strip() for name in only.split(",") if name.strip()}


def _selected(variants: dict[str, Variant], only: str) -> dict[str, Variant]:
    """The variants named in ``only`` (comma-separated; empty: all), baselines always kept."""
    if not only:
        return variants
    wanted = _wanted(only)
    return {
        name: variant
        for name, variant in variants.items()
        if name in wanted or name in ("naive", "naive_linear")
    }


def _check_only(only: str, *known: dict[str, Variant]) -> None:
    """Stop with one line when ``--only`` names a variant this run does not have."""
    names = {name for variants in known for name in variants}
    if unknown := sorted(_wanted(only) - names):
        raise SystemExit(f"--only: no variant {', '.join(unknown)}; this run has {sorted(names)}")


def _ints(text: str) -> list[int]:
    return [int(part) for part in filter(None, text.split(","))]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_argument(parser)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096, help="H of the fused linear forms")
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
    parser.add_argument(
        "--fused-chunks",
        default="",
        help="comma-separated tokens per chunk: extra grads_in_forward(_fast)_cN rows (CUDA)",
    )
    parser.add_argument(
        "--ignore-every",
        type=int,
        default=16,
        help="every K-th label is ignore_index (default 16; 2: half the tokens, as RL prompts)",
    )
    parser.add_argument(
        "--autocast",
        action="store_true",
        help="linear rows: fp32 leaves (bf16 values) under torch.autocast in --dtype",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated variants to run besides the baselines naive and naive_linear",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: stdout only)")
    args = parser.parse_args(argv)
    if args.ignore_every < 1:
        parser.error(f"--ignore-every must be >= 1, got {args.ignore_every}")
    if args.quick:
        args.tokens, args.vocab, args.hidden = 64, 1000, 32
        args.repeats, args.warmup = 2, 1

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    t, v, h = args.tokens, args.vocab, args.hidden
    labels = torch.randint(0, v, (t,), device=device)
    labels[:: args.ignore_every] = IGNORE
    logits = torch.randn(t, v, device=device, dtype=dtype).requires_grad_()
    logits_bytes = logits.numel() * logits.element_size()

    def loss_of_logits(x: torch.Tensor) -> torch.Tensor:
        return naive_loss(x, labels)

    reference = fp32_reference([logits], loss_of_logits)
    floors = {"logits": rounding_floor(reference[1], dtype)}
    on_logits = logits_variants(logits, labels, device)
    if args.no_linear:
        _check_only(args.only, on_logits)

    def measured(
        candidates: dict[str, Variant], reference: tuple[torch.Tensor, list[torch.Tensor]]
    ) -> list[Row]:
        return measure(
            _selected(candidates, args.only),
            device=device,
            warmup=args.warmup,
            repeats=args.repeats,
            logits_bytes=logits_bytes,
            reference=reference,
        )

    rows = measured(on_logits, reference)
    del reference
    if not args.no_linear:
        hidden = torch.randn(t, h, device=device, dtype=dtype).requires_grad_()
        weight = (torch.randn(v, h, device=device, dtype=dtype) / h**0.5).requires_grad_()
        if args.autocast:  # fp32 master tensors holding the same values
            hidden = hidden.detach().float().requires_grad_()
            weight = weight.detach().float().requires_grad_()

        def loss_of_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return naive_loss(x @ w.T, labels)

        reference = fp32_reference([hidden, weight], loss_of_linear)
        floors["linear"] = rounding_floor(reference[1], dtype)
        variants = linear_variants(
            hidden,
            weight,
            labels,
            device,
            linear_blocks=_ints(args.linear_blocks),
            fused_chunks=_ints(args.fused_chunks),
            autocast_dtype=dtype if args.autocast else None,
        )
        _check_only(args.only, on_logits, variants)
        rows += measured(variants, reference)
        del reference

    bandwidth = _copy_bandwidth(logits_bytes, device, args.repeats)
    floor_ms = 3 * logits_bytes / bandwidth * 1e3
    by_name = {row.variant: row for row in rows}
    for row in rows:
        base = by_name[row.baseline].median_ms
        if row.median_ms is not None and base is not None:
            row.speedup = base / row.median_ms
            row.over_floor = row.median_ms / floor_ms
    _print(
        rows,
        args=args,
        device=device,
        logits_bytes=logits_bytes,
        floor_ms=floor_ms,
        bandwidth=bandwidth,
        floors=floors,
    )

    report = {
        **run_info(device),
        "tokens": t,
        "ignore_every": args.ignore_every,
        "vocab": v,
        "hidden": h,
        "dtype": args.dtype,
        "autocast": args.autocast,
        "repeats": args.repeats,
        "logits_gib": logits_bytes / GIB,
        "copy_bandwidth_gbps": bandwidth / 1e9,
        "floor_ms": floor_ms,
        "rounding_floor_rel_err": floors,
        "rows": [asdict(r) for r in rows],
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print(
    rows: list[Row],
    *,
    args: argparse.Namespace,
    device: torch.device,
    logits_bytes: int,
    floor_ms: float,
    bandwidth: float,
    floors: dict[str, float],
) -> None:
    amp = "; linear rows: fp32 leaves under autocast" if args.autocast else ""
    print(
        f"T={args.tokens} V={args.vocab} H={args.hidden} {args.dtype}{amp} on {device} "
        f"({device_name(device)})"
    )
    print(
        f"logits {logits_bytes / GIB:.4g} GiB; floor {floor_ms:.4g} ms at "
        f"{bandwidth / 1e9:.3g} GB/s measured copy bandwidth (3 passes over the logits)"
    )
    print(
        "rounding floor of the gradient error (fp32 reference rounded to "
        f"{args.dtype}): " + ", ".join(f"{k} {v:.2e}" for k, v in floors.items())
    )
    print(
        f"{'variant':<26}{'median ms':>11}{'peak extra GiB':>16}{'x logits':>10}"
        f"{'transient':>11}{'speedup':>9}{'x floor':>9}{'loss err':>10}{'grad err':>10}  status"
    )
    for row in rows:
        speedup = "-" if row.speedup is None else f"{row.speedup:.2f}x"
        over = "-" if row.over_floor is None else f"{row.over_floor:.1f}x"
        print(
            f"{row.variant:<26}{_fmt(row.median_ms, '.3f'):>11}{_fmt(row.peak_extra_gib, '.3f'):>16}"
            f"{_fmt(row.extra_over_logits, '.2f'):>10}{_fmt(row.transient_over_logits, '.3f'):>11}"
            f"{speedup:>9}{over:>9}{_fmt(row.loss_rel_err, '.1e'):>10}"
            f"{_fmt(row.grad_rel_err, '.1e'):>10}  {row.status}"
        )
    print(
        "speedup: vs the row's baseline (naive, or naive_linear for the linear forms); "
        "x logits: peak extra / logits bytes; transient: the same without the returned "
        "gradients; errors: relative to the fp32 reference"
    )


if __name__ == "__main__":
    main()
