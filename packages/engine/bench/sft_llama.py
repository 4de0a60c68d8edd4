"""One-GPU SFT step of a ~1.5B Llama-style model through the Engine with FSDP2 mixed precision.

Model: hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192, vocabulary 128256,
untied head (1.50B parameters), SDPA attention, batch 4 x 4096 tokens, fused AdamW, bf16
parameters with fp32 gradient reduction (FSDP2 MixedPrecisionPolicy) and fp32 master weights.
Model FLOPs per token = 6 * parameters + 6 * layers * hidden * sequence (causal attention).

    python packages/engine/bench/sft_llama.py --device cuda --baseline --out sft.json
    python packages/engine/bench/sft_llama.py --quick        # tiny config on the CPU

``--baseline`` adds the plain bf16 loop of the reference measurement (bf16 weights, no master
weights, no FSDP, no Engine) in the same run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from train_engine import Engine, FSDP2Config, apply_data_parallel, param_groups
from train_testing.bench import (
    add_sft_step_arguments,
    environment,
    flops_per_token,
    free_memory,
    init_process_group,
    llama_config,
    llama_dims,
    peak_gib,
    report,
    resolve_sft_step_sizes,
    sync,
)
from train_testing.tiny_hf import parameters_to

REFERENCE = {"device": "H100", "setup": "plain bf16 loop", "tokens_per_s": 45.0e3, "tflops": 441}


def build_config(args: argparse.Namespace) -> Any:
    try:
        return llama_config(llama_dims(quick=args.quick), max_len=args.seq)
    except ImportError as err:
        raise SystemExit(str(err)) from err


def batches(args: argparse.Namespace, vocab: int, device: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def run(args: argparse.Namespace, *, engine_mode: bool) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    device = args.device
    config = build_config(args)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
    fused = device == "cuda"
    if engine_mode:
        mesh = init_device_mesh(device, (1,))
        bf16 = torch.bfloat16 if device == "cuda" else None
        model = apply_data_parallel(
            model, mesh=mesh, config=FSDP2Config(param_dtype=bf16, reduce_dtype=torch.float32)
        )
        opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-5, fused=fused)
        engine = Engine(model, opt, max_grad_norm=1.0)

        def step(batch: dict[str, torch.Tensor]) -> None:
            engine.backward(engine(**batch).loss)
            engine.step()

        name = "Engine + FSDP2 (bf16 params, fp32 reduce, fp32 master)"
    else:
        if device == "cuda":
            model = parameters_to(model, torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)

        def step(batch: dict[str, torch.Tensor]) -> None:
            model(**batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        name = "plain bf16 loop (no master weights)"
    data = batches(args, config.vocab_size, device)
    for i in range(args.warmup):
        step(data[i % 2])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    start = time.perf_counter()
    for i in range(args.steps):
        step(data[i % 2])
    sync(device)
    seconds = (time.perf_counter() - start) / args.steps
    tokens_per_s = args.batch * args.seq / seconds
    row = {
        "variant": name,
        "ms/step": seconds * 1e3,
        "tokens/s": tokens_per_s,
        "model TFLOP/s": tokens_per_s * flops_per_token(n_params, config, args.seq) / 1e12,
        "peak GiB": peak_gib(device),
        "params (B)": n_params / 1e9,
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sft_step_arguments(parser)
    parser.add_argument("--baseline", action="store_true", help="also time the plain bf16 loop")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny config, CPU is fine")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    resolve_sft_step_sizes(args)
    init_process_group(args.device)
    rows = []
    if args.baseline:
        rows.append(run(args, engine_mode=False))
        free_memory(args.device)
    rows.append(run(args, engine_mode=True))
    meta = {**environment(args.device), **vars(args), "reference": REFERENCE}
    report(
        f"SFT step, batch {args.batch} x {args.seq} tokens ({args.device})",
        rows,
        ["variant", "ms/step", "tokens/s", "model TFLOP/s", "peak GiB", "params (B)"],
        args.out,
        meta,
    )


if __name__ == "__main__":
    main()
