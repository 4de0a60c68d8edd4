"""Side-by-side A/B of the grads-in-forward linear loss against Liger's fused linear CE (CUDA only).

# T tokens, C tokens per chunk, H hidden, V vocabulary

Every variant is one forward+backward of the token-sum loss over hidden [T, H] and weight
[V, H] (bf16), timed with CUDA events in turns (variant 1, 2, ..., 1, 2, ...) so that clock
and power drift hit all of them alike; transient memory is the peak above the inputs minus the
returned gradients, over the [T, V] bf16 logits. Variants:

    ours_cC        vocab_parallel.linear_cross_entropy(..., chunk_size=C, fp32_weight_grad=False)
                   (the ignored tokens left out of the matmuls: ``skip_ignored``, the default)
    oursAll_cC     the same with skip_ignored=False: every token through the matmuls
    ours2s_cC      the same, each chunk's weight-gradient matmul on a second CUDA stream beside
                   its hidden-gradient matmul (both read the chunk's gradient; a trial, patched in)
    oursHT_cC      the same, the hidden-gradient rows as [H, C] = W.T @ G.T copied transposed
                   (a trial, patched in)
    oursLH_cC      the same, the logits as one batched matmul over the two vocabulary halves
                   written through a strided view (a trial, patched in)
    oursHK{S}_cC   the same, the hidden-gradient rows split over S vocabulary slices (split K,
                   summed in fp32; S = 2, 4; a trial); oursLHK{S}_cC both trials at once
    oursS{S}_cC    the same, the accumulation as one batched matmul over S vocabulary slices
                   (``--slices``; a trial, patched in; the library runs S=2 on CUDA)
    ours_cC_bBwW   the same, the loss-and-gradient kernel launched with BLOCK=B, num_warps=W
                   (``--loss-configs BxW,...``; a trial, patched in)
    oursQ{P}_cC    the same, products P through quack's CuTe-DSL GEMMs (``--quack-from`` a
                   ``quack_gemms.py`` JSON: its fastest config per product and chunk; P is L for
                   the logits, H the hidden gradient, W the weight-gradient accumulation in
                   ``--quack-acc-mode``, LHW all three; a trial, patched in)
    liger          liger_kernel's fused linear cross-entropy

``--board`` samples the GPU's power draw and SM clock during the timed turns (through
``nvidia-smi``) and reports them next to the times. ``--profile`` records a few back-to-back
steps of the named variants with the CUDA and CPU activities and prints the GPU's busy time per
kernel name and its idle gaps. The chunk's matmuls alone, at each chunk size:
``chunk_matmuls.py``.

    python packages/vocab-parallel/bench/fused_linear_ab.py --tokens 16384 --chunks 768,816,1024
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

import vocab_parallel as vp
from train_testing.bench import board_samples, event_ms
from vocab_parallel import _fused_linear

IGNORE = -100
GIB = 1 << 30


@contextlib.contextmanager
def _patched(
    name: str, replacement: Callable[..., object], module: ModuleType = _fused_linear
) -> Iterator[None]:
    """Replace the function ``name`` of ``module`` (the fused loss's) while the block runs."""
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def _loss_kernel_config(block: int, warps: int) -> contextlib.AbstractContextManager[None]:
    """The row kernels launched with (BLOCK, num_warps) instead of the library's choice (in the
    fused loss the loss-and-gradient kernel is the only one): fewer, wider programs keep fewer
    rows in flight, so more of a row is still in L2 when its gradient pass reads it again."""
    from vocab_parallel import _triton

    return _patched("_launch_config", lambda n_cols: (block, warps), _triton)


def _halves_logits() -> contextlib.AbstractContextManager[None]:
    """The chunk's logits as one batched matmul over the two vocabulary halves, written through
    a strided view into the [C, V] buffer (as the accumulation's halves: cuBLAS picks its kernel
    by shape, and in a power-bound loop a kernel's energy sets its time)."""

    def chunk_logits(h_chunk, weight):  # type: ignore[no-untyped-def]
        c, (v, h) = h_chunk.shape[0], weight.shape
        out = torch.empty(c, v, dtype=h_chunk.dtype, device=h_chunk.device)
        out.view(c, 2, v // 2).transpose(0, 1).baddbmm_(
            h_chunk.unsqueeze(0).expand(2, -1, -1), weight.view(2, v // 2, h).transpose(1, 2),
            beta=0,
        )  # fmt: skip
        return out

    return _patched("_chunk_logits", chunk_logits)


def _hidden_grad_formed(
    form: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> contextlib.AbstractContextManager[None]:
    """The library's chunk matmuls, the chunk's hidden-gradient rows formed by ``form(G, W)``
    instead ([C, H], copied into the rows; the weight gradient as the library forms it)."""
    original = _fused_linear._chunk_matmuls

    def chunk_matmuls(grad_logits, h_chunk, weight, hidden_rows, accumulator, first):  # type: ignore[no-untyped-def]
        # The weight gradient first: the hidden rows may be h_chunk's gathered buffer.
        original(grad_logits, h_chunk, weight, None, accumulator, first)
        if hidden_rows is not None:
            hidden_rows.copy_(form(grad_logits, weight))

    return _patched("_chunk_matmuls", chunk_matmuls)


def _split_hidden_grad(slices: int) -> contextlib.AbstractContextManager[None]:
    """The chunk's hidden-gradient rows as ``slices`` batched products over vocabulary slices
    (split K), summed in fp32 and rounded once."""

    def form(grad_logits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        c, v = grad_logits.shape
        return torch.bmm(
            grad_logits.view(c, slices, v // slices).transpose(0, 1),
            weight.view(slices, v // slices, -1),
            out_dtype=torch.float32,
        ).sum(0)

    return _hidden_grad_formed(form)


@contextlib.contextmanager
def _halves_logits_split_hidden_grad(slices: int) -> Iterator[None]:
    with _halves_logits(), _split_hidden_grad(slices):
        yield


def _two_streams() -> contextlib.AbstractContextManager[None]:
    """The library's chunk matmuls, the weight-gradient one on a second stream."""
    original = _fused_linear._chunk_matmuls
    side = torch.cuda.Stream()

    def chunk_matmuls(grad_logits, h_chunk, weight, hidden_rows, accumulator, first):  # type: ignore[no-untyped-def]
        if hidden_rows is not None and hidden_rows.data_ptr() == h_chunk.data_ptr():
            # A gathered chunk's hidden rows reuse its buffer: the products must take turns.
            original(grad_logits, h_chunk, weight, hidden_rows, accumulator, first)
            return
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        original(grad_logits, h_chunk, weight, hidden_rows, None, first)
        with torch.cuda.stream(side):
            original(grad_logits, h_chunk, weight, None, accumulator, first)
        # The chunk buffer is freed on the main stream after this: the next chunk's logits
        # may reuse it only once the side stream is done reading it.
        main.wait_stream(side)

    return _patched("_chunk_matmuls", chunk_matmuls)


def _transposed_hidden_grad() -> contextlib.AbstractContextManager[None]:
    """The chunk's hidden-gradient rows formed as [H, C] = W.T @ G.T and copied transposed
    (cuBLAS tiles that output differently from [C, H])."""
    return _hidden_grad_formed(lambda grad_logits, weight: torch.mm(weight.T, grad_logits.T).T)


def _sliced_accumulation(slices: int) -> contextlib.AbstractContextManager[None]:
    """The library's accumulation (two vocabulary halves on CUDA) over ``slices`` equal
    vocabulary slices instead: the same sums, one batched matmul; cuBLAS picks its kernel by
    shape."""

    def accumulate(accumulator, grad_logits, h_chunk):  # type: ignore[no-untyped-def]
        c, v = grad_logits.shape
        acc3 = accumulator.view(slices, v // slices, -1)  # [S, V/S, H]
        g3 = grad_logits.view(c, slices, v // slices).permute(1, 2, 0)  # [S, V/S, C], no copy
        acc3.baddbmm_(g3, h_chunk.unsqueeze(0).expand(slices, -1, -1))

    return _patched("accumulate_weight_grad_", accumulate)


@contextlib.contextmanager
def _quack_products(best: dict[str, str], products: str, acc_mode: str) -> Iterator[None]:
    """The chunk products named in ``products`` (L, H, W) through quack's GEMMs, with the
    configs ``best`` names (``_quack.py``)."""
    import _quack

    with contextlib.ExitStack() as stack:
        if "L" in products:
            stack.enter_context(_patched("_chunk_logits", _quack.logits_fn(best["logits"])))
        if "H" in products:
            hgrad = _quack.hgrad_fn(best["hgrad"])
            original = _fused_linear._chunk_matmuls

            def chunk_matmuls(grad_logits, h_chunk, weight, hidden_rows, accumulator, first):  # type: ignore[no-untyped-def]
                original(grad_logits, h_chunk, weight, None, accumulator, first)
                if hidden_rows is not None:  # after: it may be h_chunk's gathered buffer
                    hgrad(grad_logits, weight, hidden_rows)

            stack.enter_context(_patched("_chunk_matmuls", chunk_matmuls))
        if "W" in products:
            choice = _quack.QuackChoice(config=best[f"acc_{acc_mode}"], mode=acc_mode)
            stack.enter_context(_patched("accumulate_weight_grad_", _quack.acc_fn(choice)))
        yield


def _variants(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunks: list[int],
    slices: list[int],
    loss_configs: list[tuple[int, int]],
    quack_best: dict[str, dict[str, str]],
    quack_acc_mode: str,
) -> dict[str, Callable[[], object]]:
    def clear() -> None:
        hidden.grad = weight.grad = None

    def ours(
        chunk: int,
        patch: Callable[[], contextlib.AbstractContextManager[None]],
        skip_ignored: bool = True,
    ) -> Callable[[], object]:
        """One step of the library's loss, with the trial ``patch`` (a fresh context) in force."""

        def step() -> None:
            clear()
            with patch():
                loss = vp.linear_cross_entropy(
                    hidden, weight, labels, reduction="sum", chunk_size=chunk,
                    fp32_weight_grad=False, skip_ignored=skip_ignored,
                )  # fmt: skip
                loss.backward()

        return step

    out: dict[str, Callable[[], object]] = {}
    for chunk in chunks:
        out[f"ours_c{chunk}"] = ours(chunk, contextlib.nullcontext)
        out[f"oursAll_c{chunk}"] = ours(chunk, contextlib.nullcontext, skip_ignored=False)
        out[f"ours2s_c{chunk}"] = ours(chunk, _two_streams)
        out[f"oursHT_c{chunk}"] = ours(chunk, _transposed_hidden_grad)
        out[f"oursLH_c{chunk}"] = ours(chunk, _halves_logits)
        for count in (2, 4):
            out[f"oursHK{count}_c{chunk}"] = ours(chunk, partial(_split_hidden_grad, count))
            out[f"oursLHK{count}_c{chunk}"] = ours(
                chunk, partial(_halves_logits_split_hidden_grad, count)
            )
        for count in slices:
            out[f"oursS{count}_c{chunk}"] = ours(chunk, partial(_sliced_accumulation, count))
        for block, warps in loss_configs:
            out[f"ours_c{chunk}_b{block}w{warps}"] = ours(
                chunk, partial(_loss_kernel_config, block, warps)
            )
        if str(chunk) in quack_best:
            for products in ("W", "L", "H", "LHW"):
                out[f"oursQ{products}_c{chunk}"] = ours(
                    chunk,
                    partial(_quack_products, quack_best[str(chunk)], products, quack_acc_mode),
                )
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as err:  # a peer is optional: say so and time the rest
        print(f"liger: not importable ({err})")
    else:

        def liger() -> None:
            clear()
            liger_fused_linear_cross_entropy(
                hidden, weight, labels, ignore_index=IGNORE, reduction="sum"
            ).backward()

        out["liger"] = liger
    return out


def _grad_check(
    variants: dict[str, Callable[[], object]],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
) -> dict[str, float]:
    """Worst relative gradient error of each variant against an fp32 matmul + cross-entropy."""
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(
        h32 @ w32.T, labels, ignore_index=IGNORE, reduction="sum"
    )
    ref = torch.autograd.grad(loss, (h32, w32))
    del loss, h32, w32
    errors = {}
    for name, step in variants.items():
        step()
        got = (hidden.grad, weight.grad)
        errors[name] = max(
            float((g.float() - r).norm() / r.norm()) for g, r in zip(got, ref, strict=True)
        )
    hidden.grad = weight.grad = None
    return errors


def _transient(step: Callable[[], object], logits_bytes: int) -> float:
    """Peak memory of a step above what was allocated before it, over the logits' bytes.

    The step frees the previous step's gradients before it allocates its own, so the
    returned gradients cancel out and what remains is the step's transient memory.
    """
    step()  # warm: the allocator's blocks and the kernels exist
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / logits_bytes


def gpu_timeline(prof: torch.profiler.profile, steps: int = 1, top: int = 10) -> dict:
    """Per step: the GPU's span, its idle time and largest gaps, and busy time per kernel name.

    Args:
        prof: a finished profile with the CUDA activity.
        steps: how many steps it recorded (times are divided by it).
        top: how many kernel names and gaps to keep.
    """
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0
    ]
    intervals = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    if not intervals:
        return {"steps": steps, "note": "no GPU events"}
    busy_by_name: dict[str, float] = defaultdict(float)
    for start, end, name in intervals:
        busy_by_name[name[:70]] += (end - start) / 1e3
    gaps, end_so_far = [], intervals[0][1]
    for start, end, name in intervals[1:]:
        if start > end_so_far:
            gaps.append((round((start - end_so_far) / 1e3, 3), name[:50]))
        end_so_far = max(end_so_far, end)
    return {
        "steps": steps,
        "gpu_span_ms_per_step": (end_so_far - intervals[0][0]) / 1e3 / steps,
        "idle_ms_per_step": sum(g for g, _ in gaps) / steps,
        "largest_gaps_ms": sorted(gaps, reverse=True)[:top],
        "busy_ms_per_step": {
            k: round(v / steps, 3)
            for k, v in sorted(busy_by_name.items(), key=lambda kv: -kv[1])[:top]
        },
    }


def _profile(name: str, step: Callable[[], object], steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    report = {"variant": name, **gpu_timeline(prof, steps)}
    print(json.dumps(report, indent=1), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--chunks", default="768,816,1024")
    parser.add_argument(
        "--ignore-every",
        type=int,
        default=16,
        help="label every K-th token ignore_index (0: none), as the earlier rounds' 16",
    )
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--slices",
        default="",
        help="comma-separated S: add oursS{S}_cC, the accumulation batched over S vocabulary "
        "slices",
    )
    parser.add_argument(
        "--loss-configs",
        default="",
        help="comma-separated BLOCKxWARPS: add ours_cC_bBwW, the loss kernel so launched",
    )
    parser.add_argument(
        "--board",
        action="store_true",
        help="sample the GPU's power draw and SM clock (nvidia-smi) during the timed turns",
    )
    parser.add_argument(
        "--quack-from",
        type=Path,
        default=None,
        help="a quack_gemms.py JSON: add oursQ{W,L,H,LHW}_cC with its fastest configs",
    )
    parser.add_argument("--quack-acc-mode", choices=("load", "reduce"), default="load")
    parser.add_argument("--only", default="", help="comma-separated variant names to keep")
    parser.add_argument("--profile", default="", help="comma-separated variants to profile")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    t, v, h = args.tokens, args.vocab, args.hidden
    chunks = [int(c) for c in args.chunks.split(",") if c]
    torch.manual_seed(0)
    hidden = torch.randn(t, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5).requires_grad_()
    labels = torch.randint(0, v, (t,), device="cuda")
    if args.ignore_every:
        labels[:: args.ignore_every] = IGNORE
    logits_bytes = t * v * 2
    slices = [int(c) for c in args.slices.split(",") if c]
    if any(v % count for count in slices):
        parser.error(f"--slices {args.slices}: each must divide the vocabulary ({v})")
    try:
        loss_configs = [
            (int(block), int(warps))
            for block, warps in (c.split("x") for c in args.loss_configs.split(",") if c)
        ]
    except ValueError:
        parser.error(f"--loss-configs {args.loss_configs}: expected BLOCKxWARPS,... (4096x4)")
    quack_best = json.loads(args.quack_from.read_text())["best"] if args.quack_from else {}
    if quack_best and not all(str(chunk) in quack_best for chunk in chunks):
        parser.error(
            f"--quack-from {args.quack_from} has configs for chunks {sorted(quack_best)}, not all "
            f"of --chunks {args.chunks}; run quack_gemms.py --chunks {args.chunks}"
        )
    variants = _variants(
        hidden, weight, labels, chunks, slices, loss_configs, quack_best, args.quack_acc_mode
    )
    if args.only:
        keep = set(args.only.split(","))
        variants = {k: fn for k, fn in variants.items() if k in keep}
    errors = _grad_check(variants, hidden, weight, labels)
    transient = {name: _transient(step, logits_bytes) for name, step in variants.items()}
    for _ in range(args.warmup):
        for step in variants.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    board: dict[str, object] = {}
    sampling = board_samples(board) if args.board else contextlib.nullcontext()
    with sampling:
        for _ in range(args.repeats):
            for name, step in variants.items():
                times[name].append(event_ms(step))
    medians = {name: statistics.median(ms) for name, ms in times.items()}
    liger = medians.get("liger")
    print(f"T={t} V={v} H={h} {torch.cuda.get_device_name()} torch {torch.__version__}")
    print(f"{'variant':<16}{'median ms':>10}{'min':>9}{'max':>9}{'vs liger':>9}"
          f"{'peak/logits':>12}{'grad err':>10}")  # fmt: skip
    for name, ms in medians.items():
        ratio = f"{liger / ms:.3f}x" if liger else "-"
        print(
            f"{name:<16}{ms:>10.2f}{min(times[name]):>9.2f}{max(times[name]):>9.2f}{ratio:>9}"
            f"{transient[name]:>12.4f}{errors[name]:>10.2e}"
        )
    if board:
        print(f"board during the timed turns: {json.dumps(board)}")
    profiles = [_profile(n, variants[n], args.profile_steps) for n in args.profile.split(",") if n]
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "tokens": t,
                    "vocab": v,
                    "hidden": h,
                    "times_ms": times,
                    "medians_ms": medians,
                    "peak_over_logits": transient,
                    "grad_rel_err": errors,
                    "board": board,
                    "profiles": profiles,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
