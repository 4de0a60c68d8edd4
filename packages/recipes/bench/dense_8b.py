"""An 8B-class dense Llama fine-tuned on one GPU with FSDP2 + activation checkpointing, and the
cost of activation checkpointing on the 1.5B step, side by side.

Variants (each in this process, one after the other; random init from a config):

- ``1.5b``: hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocabulary 128256 (bench/sft_step.py's
  model), no checkpointing.
- ``1.5b+ac``: the same with every decoder layer checkpointed.
- ``8b+ac``: hidden 4096, 32 layers, 32/8 heads, MLP 14336, vocabulary 128256 (Llama-3-8B's
  shape, 8.03B parameters), every layer checkpointed; FSDP2 reshards after forward. With
  ``--cpu-offload`` (used only if it does not fit otherwise) FSDP2 keeps parameters, gradients
  and optimizer state on the host.
- ``load``: the 8B model saved in bf16 (safetensors, 5 GB shards) into ``--load-dir``, then loaded
  onto the GPU twice in this process: ``from_pretrained`` + ``.to(cuda)`` + FSDP2, and the
  recipe's meta-device build + FSDP2 + sharded load; seconds and peak host memory growth (VmHWM)
  of each.

Every variant: the recipe's parts (build_parallel_model's order: checkpointing, compiled decoder
layers, FSDP2 with bf16 compute, fp32 master weights and fp32 gradient reduction), the
vocab-parallel token-sum loss, Engine backward/step with fused AdamW and clipping at 1.0.
Median of CUDA-event step times after warm-up; model FLOPs as the recipe counts them
(``train_recipes.loop.throughput``: 6 x the matmul weights per token, embedding excluded, plus causal
attention; recomputation not counted, so checkpointing shows as lower MFU); MFU against
``--peak-tflops`` (989: H100/H200 SXM dense bf16).

    python packages/recipes/bench/dense_8b.py --out dense_8b.json
    python packages/recipes/bench/dense_8b.py --variants 8b+ac --batch 2 --seq 4096 --ac-every 2
    python packages/recipes/bench/dense_8b.py --variants load --load-dir /tmp/llama8b
    python packages/recipes/bench/dense_8b.py --quick      # tiny models on the CPU (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from train_engine import Engine, FSDP2Config, apply_data_parallel, param_groups
from train_recipes.loop.throughput import model_counts
from train_recipes.model.activation_checkpointing import apply_activation_checkpointing
from train_recipes.model.build import compile_decoder_layers
from train_recipes.sft.run import token_sum_loss

SHAPES = {
    "1.5b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
VARIANTS = {"1.5b": ("1.5b", False), "1.5b+ac": ("1.5b", True), "8b+ac": ("8b", True)}


def _vmhwm_bytes(reset: bool = False) -> int:
    """This process's peak RSS (Linux); ``reset`` first lowers it to the current RSS."""
    if reset:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_load(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """from_pretrained vs the sharded load of the same checkpoint, on one rank."""
    folder = args.load_dir or tempfile.mkdtemp(prefix="dense_8b_ckpt_")
    try:
        return _compare_loads(folder, args, device)
    finally:
        if args.load_dir is None:  # a checkpoint this run wrote for itself
            shutil.rmtree(folder, ignore_errors=True)


def _compare_loads(
    folder: str, args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from train_recipes.model.loading import build_on_meta, load_sharded_safetensors

    shape = TINY if args.quick else SHAPES["8b"]
    if not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(0)
        model = _model(shape, vocab=256 if args.quick else 128256, device=device)
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="5GB")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    mesh = init_device_mesh(device.type, (1,))
    rows = []
    for name in ("from_pretrained", "sharded_load"):
        base = _vmhwm_bytes(reset=True)
        t0 = time.perf_counter()
        if name == "from_pretrained":
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
            model = apply_data_parallel(model, mesh=mesh, config=FSDP2Config())
        else:
            model = build_on_meta(
                folder, dtype=torch.float32, attn_implementation="sdpa", image_text=False
            )
            model = apply_data_parallel(model, mesh=mesh, config=FSDP2Config())
            load_sharded_safetensors(model, folder, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "variant": f"load:{name}",
                "seconds": seconds,
                "host_peak_growth_gib": (_vmhwm_bytes() - base) / 2**30,
            }
        )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _model(shape: dict[str, int], *, vocab: int, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape,
        num_attention_heads=32 if shape is not TINY else 4,
        num_key_value_heads=8 if shape is not TINY else 2,
        vocab_size=vocab,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    with torch.device(device):  # fp32 master weights, initialised where they live
        model = LlamaForCausalLM(config)
    return model


def run_variant(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shape_name, checkpointing = VARIANTS[name]
    shape = TINY if args.quick else SHAPES[shape_name]
    vocab = 256 if args.quick else 128256
    torch.manual_seed(0)
    model = _model(shape, vocab=vocab, device=device)
    params = sum(p.numel() for p in model.parameters())
    counts = model_counts(model)
    if checkpointing:
        apply_activation_checkpointing(model, every=args.ac_every)
    if args.compile:
        compile_decoder_layers(model, backend="inductor" if device.type == "cuda" else "aot_eager")
    big = shape_name == "8b"
    fsdp = FSDP2Config(
        param_dtype=torch.bfloat16 if device.type == "cuda" else None,
        reduce_dtype=torch.float32 if device.type == "cuda" else None,
        # One GPU: keeping the unsharded bf16 weights between forward and backward saves the
        # second all-gather copy, but 8B cannot afford 16 GB more.
        reshard_after_forward=big,
        cpu_offload=args.cpu_offload and big,
    )
    model = apply_data_parallel(model, mesh=init_device_mesh(device.type, (1,)), config=fsdp)
    fused = device.type == "cuda" and not fsdp.cpu_offload
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay=0.0), lr=1e-5, fused=fused)
    engine = Engine(model, optimizer, max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
    batch = {
        "input_ids": ids,
        "labels": torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1),
        "position_ids": torch.arange(args.seq, device=device).expand(args.batch, -1),
    }
    tokens = args.batch * args.seq

    num_tokens = torch.tensor(float(tokens), device=device)

    def step(engine: Engine) -> None:
        loss = token_sum_loss(engine, batch)
        engine.backward(loss, num_tokens=num_tokens)
        engine.step()

    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(engine)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            step(engine)
            elapsed = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(elapsed)
    seconds = statistics.median(times)
    flops = counts.batch_flops({"attention_mask": torch.ones(args.batch, args.seq)})["total"]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    row = {
        "variant": name,
        "parameters": params,
        "activation_checkpointing": checkpointing,
        "cpu_offload": fsdp.cpu_offload,
        "ms_per_step": 1e3 * seconds,
        "tokens_per_s": tokens / seconds,
        "mfu": flops / seconds / (args.peak_tflops * 1e12),
        "peak_gib": peak,
    }
    del engine, optimizer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--cpu-offload", action="store_true", help="8B: FSDP2 CPU offload")
    parser.add_argument("--quick", action="store_true", help="tiny models on the CPU")
    parser.add_argument("--ac-every", type=int, default=1, help="checkpoint every k-th layer")
    parser.add_argument("--load-dir", default=None, help="load variant: checkpoint folder")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.steps, args.warmup = 2, 32, 2, 1
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.quick else None
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
    )
    rows = []
    try:
        for name in args.variants.split(","):
            try:
                if name == "load":
                    rows.extend(run_load(args, device))
                    continue
                rows.append(run_variant(name, args, device))
            except torch.OutOfMemoryError:
                rows.append({"variant": name, "error": "out of memory (try --cpu-offload)"})
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)
    print(
        f"{'variant':10} {'params':>8} {'ms/step':>9} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9}"
    )
    for r in rows:
        if "seconds" in r:
            print(
                f"{r['variant']:22} {r['seconds']:7.1f} s, host peak +{r['host_peak_growth_gib']:.2f} GiB"
            )
            continue
        if "error" in r:
            print(f"{r['variant']:10} {r['error']}")
            continue
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(
            f"{r['variant']:10} {r['parameters'] / 1e9:7.2f}B {r['ms_per_step']:9.1f} "
            f"{r['tokens_per_s']:10.0f} {100 * r['mfu']:6.1f}% {peak:>9}"
        )
    if args.out:
        meta = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "batch": args.batch,
            "seq": args.seq,
            "compile": args.compile,
            "ac_every": args.ac_every,
        }
        with open(args.out, "w") as handle:
            json.dump({"meta": meta, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
