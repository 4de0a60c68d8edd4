"""One AdamW update of a Llama-shaped parameter set: MasterWeightAdamW against torch's fused AdamW.

Variants (same shapes, same gradients; clipping's divisor passed in as the Engine does):
- ``MasterWeightAdamW``: bf16 parameters and gradients, fp32 master weights and moments in the
  optimizer (28 bytes per parameter).
- ``torch fused AdamW, fp32 params``: what FSDP2 mixed precision steps (fp32 parameters and
  gradients, 28 bytes per parameter), without FSDP2's casts around it.
- ``torch fused AdamW, bf16 params``: AdamW directly on bf16 weights (no master; small updates
  round away), 16 bytes per parameter.
"master err" is the worst relative error of the variant's weights after three updates against
the fp32-parameter variant's (the same fp32 arithmetic, so it should sit at fp32 rounding for
ours and at bf16 rounding for plain bf16 AdamW). Those three run on fresh optimizers with the
gradients assigned anew before each update: torch's fused AdamW divides the gradients by
``grad_scale`` in place, so the timed runs (which reuse the gradients) drift apart by design.

    python packages/engine/bench/master_adamw.py --device cuda --hidden 2048 --layers 16
    python packages/engine/bench/master_adamw.py --quick
"""

from __future__ import annotations

import torch
from _timing import report_ratios, timing_parser

from train_engine import MasterWeightAdamW
from train_testing.bench import (
    alternating_medians,
    environment,
    init_process_group,
    print_lines,
    time_ms,
)


def llama_shapes(hidden: int, layers: int, vocab: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a Llama-style model (4x MLP, 4x fewer KV heads, untied head)."""
    inter, kv = 4 * hidden, hidden // 4
    per_layer = [
        (hidden, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, hidden),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
        (hidden,),
        (hidden,),
    ]
    return [(vocab, hidden), *per_layer * layers, (hidden,), (vocab, hidden)]


def main() -> None:
    parser = timing_parser(__doc__.splitlines()[0], layers=16)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab, args.iters, args.repeats = 64, 2, 500, 2, 2
    device = args.device
    init_process_group(device)
    shapes = llama_shapes(args.hidden, args.layers, args.vocab)
    gen = torch.Generator().manual_seed(0)
    start = [(0.02 * torch.randn(s, generator=gen)).to(torch.bfloat16) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in shapes]
    divisor = torch.tensor(1.5, device=device)
    fused = device == "cuda"

    def build(kind: str) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        params = [torch.nn.Parameter(t.to(device, dtype)) for t in start]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(dtype, copy=True)
        settings = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
        opt: torch.optim.Optimizer
        if kind == "master":
            opt = MasterWeightAdamW(params, **settings)  # type: ignore[arg-type]
        else:
            opt = torch.optim.AdamW(params, fused=fused, **settings)  # type: ignore[arg-type]
        return params, opt

    runs = {kind: build(kind) for kind in ("master", "fp32", "bf16")}

    def update(opt: torch.optim.Optimizer) -> None:
        # The Engine's clipping divisor; torch's unfused (CPU) AdamW takes none, so none there.
        opt.grad_scale = divisor if fused else None  # type: ignore[attr-defined]
        opt.step()
        opt.grad_scale = None  # type: ignore[attr-defined]

    variants = {
        "MasterWeightAdamW (bf16 params, fp32 masters)": lambda: update(runs["master"][1]),
        "torch fused AdamW, fp32 params": lambda: update(runs["fp32"][1]),
        "torch fused AdamW, bf16 params (no master)": lambda: update(runs["bf16"][1]),
    }
    medians = alternating_medians(
        variants, repeats=args.repeats, measure=lambda fn: time_ms(fn, device, iters=args.iters)
    )
    n_params = sum(t.numel() for t in start)
    checked = {kind: build(kind) for kind in ("master", "fp32", "bf16")}
    for params, opt in checked.values():
        for _ in range(3):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.to(p.dtype, copy=True)  # the fused update rescales it in place
            update(opt)
    reference = checked["fp32"][0]
    master_opt = checked["master"][1]
    errors = {}
    for kind, weights in (
        ("master", [master_opt.state[p]["master_param"] for p in checked["master"][0]]),
        ("bf16", checked["bf16"][0]),
    ):
        worst = 0.0
        for got, want in zip(weights, reference, strict=True):
            diff = (
                got.detach().double() - want.detach().double()
            ).norm() / want.detach().double().norm()
            worst = max(worst, float(diff))
        errors[kind] = worst
    bytes_moved = {"master": 28, "fp32": 28, "bf16": 16}
    bandwidth = {
        kind: bytes_moved[kind] * n_params / (ms * 1e-3) / 1e9
        for kind, ms in zip(("master", "fp32", "bf16"), medians.values(), strict=True)
    }
    print_lines(
        f"GB/s: {', '.join(f'{k} {v:.0f}' for k, v in bandwidth.items())}; weights' rel err "
        f"vs fp32 params: {', '.join(f'{k} {v:.2e}' for k, v in errors.items())}"
    )
    report_ratios(
        f"AdamW update of {len(shapes)} tensors ({n_params / 1e9:.2f}B parameters, {device})",
        medians,
        baseline="torch fused AdamW, fp32 params",
        columns=("median ms", "ratio to fp32 fused AdamW"),
        out=args.out,
        meta={
            **environment(device),
            "parameters": n_params,
            "bytes per parameter": bytes_moved,
            "GB/s": bandwidth,
            "master err vs fp32 params": errors,
            **vars(args),
        },
    )


if __name__ == "__main__":
    main()
