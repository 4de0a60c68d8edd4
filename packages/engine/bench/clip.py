"""Gradient norm + clip on DDP gradients: the Engine's fast path vs its generic (sharding-aware)
path vs torch.nn.utils.clip_grad_norm_, with gradient_as_bucket_view on.

    python packages/engine/bench/clip.py --device cuda --hidden 4096 --layers 16
    python packages/engine/bench/clip.py --quick
"""

from __future__ import annotations

import torch
from _timing import report_ratios, timing_parser
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from train_engine import DDPConfig, apply_data_parallel, clip_grads_with_norm_, global_grad_norm
from train_testing.bench import alternating_medians, environment, init_process_group, time_ms


def main() -> None:
    parser = timing_parser(__doc__.splitlines()[0], layers=16)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.iters, args.repeats = 32, 4, 3, 2
    device = args.device
    init_process_group(device)
    mesh = init_device_mesh(device, (1,))
    torch.manual_seed(0)
    layers = [nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)]
    model = apply_data_parallel(
        nn.Sequential(*layers).to(device),
        mesh=mesh,
        config=DDPConfig(gradient_as_bucket_view=True),
    )
    model(torch.randn(4, args.hidden, device=device)).square().mean().backward()
    params = list(model.parameters())

    def fast() -> None:
        clip_grads_with_norm_(params, 1e9, global_grad_norm(params, fast_path=True))

    def generic() -> None:
        clip_grads_with_norm_(params, 1e9, global_grad_norm(params, fast_path=False))

    def torch_foreach() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True)

    def torch_loop() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=False)

    variants = {
        "Engine fast path (foreach, no collective)": fast,
        "Engine generic path (grouped)": generic,
        "torch clip_grad_norm_(foreach=True)": torch_foreach,
        "torch clip_grad_norm_(foreach=False)": torch_loop,
    }
    medians = alternating_medians(
        variants, repeats=args.repeats, measure=lambda fn: time_ms(fn, device, iters=args.iters)
    )
    n_params = sum(p.numel() for p in params)
    report_ratios(
        f"Norm + clip of {len(params)} DDP bucket-view gradients ({n_params / 1e6:.1f}M values, {device})",
        medians,
        baseline="Engine fast path (foreach, no collective)",
        columns=("median ms", "ratio to fast path"),
        out=args.out,
        meta={**environment(device), "parameters": n_params, "tensors": len(params), **vars(args)},
    )


if __name__ == "__main__":
    main()
