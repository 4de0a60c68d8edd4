"""SFT step of a MoE model on one device: transformers' own experts against the converted model.

Model: Qwen3-30B-A3B-shaped with fewer layers (hidden 2048, 128 experts, top-8, expert FFN 768,
32 heads / 4 KV heads, head dim 128, vocab 151936), 8 layers by default, random init, bf16
weights, batch 2 x 2048 tokens. Each variant runs forward, the token-sum loss, backward and a
fused AdamW step (clipping at 1.0), one after the other in the same process:

- ``hf-loop``: transformers' model with its per-expert loop (``experts_implementation="eager"``).
- ``hf-grouped``: transformers' own grouped-mm experts, where its version has them.
- ``converted``: the same weights converted by ``moe_dispatch.convert_hf_moe`` (the recipe's
  path at ep=1: grouped ``torch._grouped_mm`` experts on CUDA for 16-bit weights).

It reports the median step time, tokens/s, peak memory and the speed-up over ``hf-loop``.

    python packages/recipes/bench/moe_step.py --out moe_step.json
    python packages/recipes/bench/moe_step.py --layers 4 --batch 1 --seq 4096
    python packages/recipes/bench/moe_step.py --quick      # tiny model on the CPU (CI)
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from typing import Any

import torch

from train_testing.tiny_hf import parameters_to

FULL = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
}
TINY = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 128,
}
VARIANTS = ("hf-loop", "hf-grouped", "converted")


def build_model(
    shape: dict[str, int],
    layers: int,
    device: torch.device,
    dtype: torch.dtype,
    experts_implementation: str,
) -> Any:
    """A random Qwen3-MoE model (same seed, so every variant starts from the same weights)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **shape, num_hidden_layers=layers, max_position_embeddings=8192, norm_topk_prob=True
    )
    config._attn_implementation = "sdpa"
    config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    with torch.device(device):
        model = parameters_to(Qwen3MoeForCausalLM(config), dtype)
    return model.train()


def run_variant(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Time ``args.steps`` SFT steps after ``args.warmup`` warm-up steps."""
    from moe_dispatch import convert_hf_moe
    from vocab_parallel import token_log_probs

    shape = TINY if args.quick else FULL
    impl = "grouped_mm" if name == "hf-grouped" else "eager"
    dtype = torch.float32 if args.quick else torch.bfloat16
    model = build_model(shape, args.layers, device, dtype, impl)
    if name == "converted":
        convert_hf_moe(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq + 1), generator=g)
    inputs, labels = ids[:, :-1].to(device), ids[:, 1:].to(device)
    positions = torch.arange(args.seq, device=device).expand(args.batch, -1)
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
        loss = -token_log_probs(logits, labels).sum() / labels.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "variant": name,
        "median_s": median,
        "tokens/s": args.batch * args.seq / median,
        "peak_gib": peak,
        "loss": float(loss.detach()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU (CI)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.batch, args.seq, args.steps, args.warmup = 2, 2, 16, 2, 1
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    rows = []
    for name in names:
        try:
            rows.append(run_variant(name, args, device))
        except (ValueError, KeyError, NotImplementedError) as err:  # e.g. no grouped_mm
            rows.append({"variant": name, "error": f"{type(err).__name__}: {err}"})
    base = next((r for r in rows if r["variant"] == "hf-loop" and "tokens/s" in r), None)
    print(f"{'variant':<12} {'median s':>9} {'tokens/s':>10} {'peak GiB':>9} {'vs hf-loop':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<12} {r['error']}")
            continue
        r["vs hf-loop"] = r["tokens/s"] / base["tokens/s"] if base else None
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        ratio = "-" if r["vs hf-loop"] is None else f"{r['vs hf-loop']:.2f}x"
        print(
            f"{r['variant']:<12} {r['median_s']:>9.4f} {r['tokens/s']:>10.0f} {peak:>9} {ratio:>10}"
        )
    result = {
        "rows": rows,
        "args": vars(args),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor(),
        "torch": torch.__version__,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
