"""Dispatch + expert compute + combine throughput on one process, and the cost of equalization.

Variants (same routing, same weights, forward + backward):
  naive-loop        the Hugging Face eager form: per expert, mask the tokens, run, index_add
  all-to-all        AllToAllDispatcher (a real all_to_all_single on a 1-rank group) + GroupedExperts
  all-to-all+equal  the same behind EqualizingDispatcher (MAX all-reduce + padding every call)
  equalize-only     just the all-reduce and the padding, reported as a fraction of a step

Example:
  python packages/moe-dispatch/bench/dispatch_throughput.py --device cuda --tokens 16384
  python packages/moe-dispatch/bench/dispatch_throughput.py --quick      # tiny CPU sizes (CI)

Multi-GPU bandwidth is out of scope here (one process); see the multi-GPU validation issue.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import moe_dispatch
from moe_dispatch import (
    AllToAllDispatcher,
    EqualizingDispatcher,
    GroupedExperts,
    equalize_token_counts,
)
from train_testing.bench import (
    device_name,
    init_process_group,
    print_lines,
    times_ms,
    versions,
    write_json,
)


def _naive_loop(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: GroupedExperts
) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    for e in range(experts.num_local_experts):
        token, slot = torch.where(ids == e)
        gate, up = F.linear(hidden[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(experts.act_fn(gate) * up, experts.down_proj[e])
        out = out.index_add(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("moe_dispatch_bench.json"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for CI")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.ffn, args.experts = 256, 32, 64, 8
        args.iters, args.warmup = 3, 1
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        # set_device needs an index on older torch (2.11): "cuda" alone is rejected.
        device = torch.device("cuda", torch.cuda.current_device())
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)

    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_process_group(device)
    try:
        rows = _run(args, device, dtype)
    finally:
        dist.destroy_process_group()

    baseline = rows[0]["median_ms"]
    step = next(r["median_ms"] for r in rows if r["variant"] == "all-to-all+equal")
    print(
        f"device={device} ({device_name(device)}) dtype={dtype_name} tokens={args.tokens} "
        f"hidden={args.hidden} ffn={args.ffn} experts={args.experts} top_k={args.top_k}"
    )
    print(f"{'variant':<18}{'median ms':>12}{'tokens/s':>14}{'vs naive':>10}{'% of step':>11}")
    for row in rows:
        row["speedup_vs_naive"] = baseline / row["median_ms"]
        row["fraction_of_step"] = row["median_ms"] / step
        print(
            f"{row['variant']:<18}{row['median_ms']:>12.3f}{row['tokens_per_s']:>14.0f}"
            f"{row['speedup_vs_naive']:>10.2f}{100 * row['fraction_of_step']:>10.1f}%"
        )
    report = {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": dtype_name,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "versions": {**versions(), "moe_dispatch": moe_dispatch.__version__},
        "rows": rows,
    }
    print_lines(f"wrote {write_json(args.json, report)}")


def _run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict]:
    torch.manual_seed(0)
    experts = GroupedExperts(args.experts, args.hidden, args.ffn, device=device, dtype=dtype)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    router = torch.randn(args.hidden, args.experts, device=device, dtype=torch.float32)
    probs = torch.softmax(hidden.detach().float() @ router, dim=-1)
    weights, ids = torch.topk(probs, args.top_k, dim=-1)
    weights.requires_grad_()
    plain = AllToAllDispatcher(None, args.experts)
    equal = EqualizingDispatcher(AllToAllDispatcher(None, args.experts))

    def naive() -> None:
        _naive_loop(hidden, ids, weights, experts).float().sum().backward()

    def through(dispatcher: AllToAllDispatcher | EqualizingDispatcher) -> Callable[[], None]:
        def step() -> None:
            x, counts, handle = dispatcher.dispatch(hidden, ids, weights)
            dispatcher.combine(experts(x, counts), handle).float().sum().backward()

        return step

    def equalize_only() -> None:
        equalize_token_counts(hidden, ids, weights)

    timed = [
        ("naive-loop", naive),
        ("all-to-all", through(plain)),
        ("all-to-all+equal", through(equal)),
        ("equalize-only", equalize_only),
    ]
    rows = []
    for name, fn in timed:
        times = times_ms(fn, device, warmup=args.warmup, iters=args.iters)
        median = statistics.median(times)
        rows.append(
            {
                "variant": name,
                "median_ms": median,
                "min_ms": min(times),
                "tokens_per_s": args.tokens / (median / 1e3),
            }
        )
    return rows


if __name__ == "__main__":
    main()
