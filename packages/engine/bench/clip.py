"""Gradient norm + clip on DDP gradients: the Engine's fast path vs its generic (sharding-aware)
path vs torch.nn.utils.clip_grad_norm_, with gradient_as_bucket_view on.

    python packages/engine/bench/clip.py --device cuda --hidden 4096 --layers 16
    python packages/engine/bench/clip.py --quick
"""

from __future__ import annotations

import argparse

import torch
from _bench_util import environment, init_single_process_group, median, report, time_ms
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from train_engine import DDPConfig, apply_data_parallel, clip_grads_with_norm_, global_grad_norm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke run)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.iters, args.repeats = 32, 4, 3, 2
    device = args.device
    init_single_process_group(device)
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
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(time_ms(fn, device, iters=args.iters))
    base = median(times["Engine fast path (foreach, no collective)"])
    n_params = sum(p.numel() for p in params)
    rows = [
        {"variant": name, "median ms": median(t), "ratio to fast path": median(t) / base}
        for name, t in times.items()
    ]
    meta = {**environment(device), "parameters": n_params, "tensors": len(params), **vars(args)}
    report(
        f"Norm + clip of {len(params)} DDP bucket-view gradients ({n_params / 1e6:.1f}M values, {device})",
        rows,
        ["variant", "median ms", "ratio to fast path"],
        args.out,
        meta,
    )


if __name__ == "__main__":
    main()
