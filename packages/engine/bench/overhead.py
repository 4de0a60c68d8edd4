"""Engine overhead: a training loop through the Engine vs the same hand-written loop.

Same model, optimizer, data, accumulation and clipping; the two loops alternate in blocks so
machine noise hits both alike. Goal: ratio <= 1.01.

    python packages/engine/bench/overhead.py --device cuda --hidden 4096 --layers 8
    python packages/engine/bench/overhead.py --quick
"""

from __future__ import annotations

import torch
from _timing import report_ratios, timing_parser
from torch import nn

from train_engine import Engine
from train_testing.bench import alternating_medians, environment, time_ms


def build(
    hidden: int, layers: int, device: str, fused: bool
) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.GELU()]
    model = nn.Sequential(*blocks, nn.Linear(hidden, 1)).to(device)
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kind)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def main() -> None:
    parser = timing_parser(__doc__.splitlines()[0], layers=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed block")
    parser.add_argument(
        "--fused",
        action="store_true",
        help="fused AdamW in both loops (the Engine then clips and skips inside the kernel)",
    )
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.batch, args.steps, args.repeats = 32, 2, 8, 3, 2
    device = args.device
    xs = [torch.randn(args.batch, args.hidden, device=device) for _ in range(args.accum)]
    ys = [torch.randn(args.batch, 1, device=device) for _ in range(args.accum)]

    def hand_loop(model: nn.Module, opt: torch.optim.Optimizer, sched: object) -> None:
        for _ in range(args.steps):
            for x, y in zip(xs, ys, strict=True):
                loss = nn.functional.mse_loss(model(x), y)
                (loss / args.accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            sched.step()  # type: ignore[attr-defined]
            opt.zero_grad(set_to_none=True)

    def engine_loop(engine: Engine) -> None:
        for _ in range(args.steps):
            for x, y in zip(xs, ys, strict=True):
                engine.backward(nn.functional.mse_loss(engine(x), y))
                engine.step()

    hand = build(args.hidden, args.layers, device, args.fused)
    variants = {
        "hand-written loop": lambda: hand_loop(*hand),
    }
    for policy in ("step", "skip"):
        model, opt, sched = build(args.hidden, args.layers, device, args.fused)
        engine = Engine(
            model,
            opt,
            sched,
            max_grad_norm=1.0,
            gradient_accumulation_steps=args.accum,
            nonfinite=policy,  # type: ignore[arg-type]
        )
        variants[f"Engine (nonfinite={policy!r})"] = lambda e=engine: engine_loop(e)
    medians = alternating_medians(
        variants, repeats=args.repeats, measure=lambda fn: time_ms(fn, device, iters=1) / args.steps
    )
    report_ratios(
        f"Engine overhead ({device}, hidden={args.hidden}, layers={args.layers}, "
        f"batch={args.batch}, accum={args.accum}, {'fused' if args.fused else 'foreach'} AdamW)",
        medians,
        baseline="hand-written loop",
        columns=("median ms/step", "ratio"),
        out=args.out,
        meta={**environment(device), **{k: v for k, v in vars(args).items() if k != "out"}},
    )


if __name__ == "__main__":
    main()
