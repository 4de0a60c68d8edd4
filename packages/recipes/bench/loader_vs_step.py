"""Does the energon-sft loader keep one GPU fed? Loader samples/s vs the SFT step's rate (VLM).

One run measures, side by side, for a Qwen2.5-VL-style SFT workload:

1. loader: the recipe's energon-sft loader (``train_recipes.data.energon_api.build_encoder`` and
   ``build_loader`` with the settings ``train_recipes.sft.run`` passes: family ``qwen2_5_vl``, packing,
   ``pad_to_multiple_of=2``, one data-parallel replica, ``--num-workers`` workers) over an Energon
   dataset written the way the VLM demo writes its own (chat JSONL + image files ->
   ``convert_chat_jsonl``): generated photo-like RGB pictures (448x448 JPEG by default, 256
   image tokens each, one or two per sample) and short multi-turn chats. Samples/s and tokens/s
   over ``--batches`` micro-batches after a warm-up that starts the workers, fills their
   buffers and drains the prefetched queue. The processor is built locally: the recipes'
   character tokenizer (one token per character; the chats are sized in characters like
   real-tokenizer tokens) and a PIL-backend Qwen2-VL image processor.
2. step: one SFT step of a random-init Qwen2.5-VL-style model built by the recipe's
   ``build_model`` (the default preset mirrors Qwen2.5-VL-3B: decoder hidden 2048, 36 layers,
   16/2 heads, MLP 11008, vocabulary 151936, tied; vision tower 32 blocks of width 1280) on the
   first ``--step-batches`` batches of that same loader, already on the device: the recipe's
   ``token_sum_loss`` (its fused linear loss) + ``Engine.backward(loss, num_tokens=...)`` +
   ``Engine.step()``, AdamW. Median over ``--steps`` steps (device synchronised) after
   ``--warmup-steps``, for each of ``--step-variants`` in turn (a fresh model from the same seed
   each, so the first step's losses agree): ``stock`` (transformers' per-window vision
   attention), ``varlen`` (``train_recipes.model.vision_attention``), then any of ``+linearpatch``
   (``train_recipes.model.patch_embed``: the patch embedding as a matmul), ``+fusedadam`` (fused AdamW:
   no host sync in ``Engine.step``), ``+compile`` (``compile_decoder_layers``: decoder layers and
   vision blocks), ``+fsdp2`` (fp32 weights, 1-rank FSDP2, bf16 compute) and ``+allpositions``
   (the fused loss over every position, ``model.fused_loss_trained_only=false``; without it the
   loss sees the trained rows only, the recipe's default). The recipe's default step on CUDA is
   ``varlen+linearpatch+fusedadam`` (this run's default). ``--step-only`` skips the loader
   measurement and writes a small dataset.
3. ratio = loader samples/s / step samples/s (the fastest variant): >= 1 means the loader
   produces batches at least as fast as one GPU consumes them.
4. MFU = model FLOPs per batch / step time / ``--peak-tflops`` (989: H100/H200 bf16 dense). The
   FLOPs, from each batch's documents (``seq_lens``) and images (``image_grid_thw``), are
   ``train_recipes.loop.throughput`` (the recipe's own MFU count): 6 x matmul weights x tokens (decoder + head) and x patches (vision
   tower; the merger x merged tokens), plus 12 x d x layers x the attended pairs: causal per
   packed document (L(L+1)/2 each) in the decoder, per window (W^2) or per image frame in the
   vision blocks. Norms, activations, the optimizer and padding are not counted.

    python packages/recipes/bench/loader_vs_step.py --device cuda --out loader_vs_step.json
    python packages/recipes/bench/loader_vs_step.py --device cuda --step-only \
        --out vlm_step.json   # before / after: stock, then each speed-up added
    python packages/recipes/bench/loader_vs_step.py --quick --out lvs.json   # tiny, CPU

The recipe's builder makes a one-block, 32-wide vision tower; the bench sets the vision config
of the preset (depth, width, heads, windows) on the builder's config before the weights are
made, and pads the model's vocabulary to the preset's size (the character tokenizer uses the
first ids only), so the vision tower, lm_head and loss cost what they cost in the real model.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

# Energon draws a progress bar per worker buffer fill; tqdm reads this when first imported
# (torch imports it).
os.environ.setdefault("TQDM_DISABLE", "1")

import torch
from _vlm_data import build_processor, write_dataset
from _vlm_model import PRESETS, STEP_ONLY_VARIANTS, StepVariant, build_vlm

from train_testing.bench import (
    add_device_argument,
    device_name,
    free_memory,
    init_process_group,
    peak_gib,
    print_lines,
    print_table,
    sync,
    versions,
    write_json,
)

logger = logging.getLogger("loader_vs_step")

# ---------------------------------------------------------------------------------- loader


def measure_loader(
    config: Any, processor: Any, *, warmup: int, batches: int, keep: int
) -> tuple[dict[str, Any], list[Any]]:
    """Throughput of the recipe's loader; returns the row and the first ``keep`` timed batches."""
    from train_recipes.data import energon_api as data_api

    data = config.data
    # The same calls, with the same arguments, as train_recipes.sft.run.run_sft on one dp rank, cp=1.
    encoder = data_api.build_encoder(
        processor,
        model_family=data.model_family,
        max_length=data.max_length,
        train_on=data.train_on,
        pad_to_multiple_of=2,
        packing=data.packing,
    )
    loader = data_api.build_loader(
        data.path,
        encoder=encoder,
        batch_size=data.micro_batch_size,
        dp_rank=0,
        dp_world_size=1,
        num_workers=data.num_workers,
        seed=config.train.seed,
        shuffle=data.shuffle,
        num_logical_shards=data.num_logical_shards,
    )
    kept: list[Any] = []
    samples = tokens = images = trained = 0
    try:
        it = iter(loader)
        t0 = time.perf_counter()
        for _ in range(warmup):
            next(it)
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(batches):
            batch = next(it)
            samples += len(batch.sample_weights)
            tokens += int(batch.attention_mask.sum())
            trained += int(batch.num_trainable_tokens)
            images += int(batch.image_grid_thw.shape[0])
            if i < keep:
                kept.append(batch)
        seconds = time.perf_counter() - t0
        stats = loader.data_stats()
    finally:
        loader.close()
    row = {
        "variant": f"loader ({data.num_workers} workers)",
        "samples/s": samples / seconds,
        "tokens/s": tokens / seconds,
        "ms/batch": seconds * 1e3 / batches,
        "samples/batch": samples / batches,
        "tokens/batch": tokens / batches,
        "trained tokens/batch": trained / batches,
        "images/batch": images / batches,
        "batches": batches,
        "warmup batches": warmup,
        "startup s": startup,
        "num_workers": data.num_workers,
        "bad-sample counters": stats,
    }
    return row, kept


# ------------------------------------------------------------------------------------ step


def measure_step(
    config: Any,
    processor: Any,
    preset: dict[str, Any],
    cpu_batches: list[Any],
    *,
    device: torch.device,
    variant: StepVariant,
    wrap: str,
    activation_checkpointing: bool,
    warmup: int,
    steps: int,
    peak_tflops: float,
    compile_backend: str,
    profile_path: Path | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Median SFT step on batches already on the device; returns (row, model description).

    A fresh model from the same seed for every variant (the first step's loss must agree).
    With ``profile_path``, two more steps are profiled after the timed ones (kernel table and
    the GPU's idle gaps, ``sft_step.profile``).
    """
    from train_engine import Engine, FSDP2Config, apply_data_parallel, param_groups
    from train_recipes.data import energon_api as data_api
    from train_recipes.data.processors import tokenizer_of
    from train_recipes.loop.throughput import check_windows, document_lengths, model_counts
    from train_recipes.loss.fused_loss import fused_head
    from train_recipes.model.build import compile_decoder_layers
    from train_recipes.model.patch_embed import use_linear_patch_embed
    from train_recipes.model.vision_attention import use_varlen_vision_attention
    from train_recipes.sft.run import token_sum_loss

    if device.type == "cuda":
        torch.cuda.set_device(device)  # main() gives it an index
    if variant.fsdp2:
        wrap = "fsdp2"
    dtype = "float32" if wrap == "fsdp2" else config.model.dtype
    torch.manual_seed(config.train.seed)
    t0 = time.perf_counter()
    model = build_vlm(config, tokenizer_of(processor), preset, device, dtype)
    build_s = time.perf_counter() - t0
    counts = model_counts(model)
    flops = [counts.batch_flops(b) for b in cpu_batches]
    for b in cpu_batches:
        check_windows(b.image_grid_thw.tolist(), model.config.vision_config, counts)
        if sum(document_lengths(b)) != int(b.attention_mask.sum()):
            raise AssertionError("the documents' seq_lens and the attention mask disagree")
    if variant.varlen and not use_varlen_vision_attention(model):
        raise SystemExit(f"variant {variant.name}: the model's vision tower is not supported")
    if variant.linear_patch and not use_linear_patch_embed(model):
        raise SystemExit(f"variant {variant.name}: the model's patch embedding is not supported")
    n_params = sum(p.numel() for p in model.parameters())
    visual = getattr(getattr(model, "model", model), "visual", None)
    n_vision = sum(p.numel() for p in visual.parameters()) if visual is not None else 0
    described = {
        "params_B": n_params / 1e9,
        "vision_params_B": n_vision / 1e9,
        "vocab_size": model.config.text_config.vocab_size,
        "text": preset["text"],
        "vision": preset["vision"],
        "dtype": dtype,
        "wrap": wrap,
        "activation_checkpointing": activation_checkpointing,
        "build_s": build_s,
        "flop_counts": asdict(counts),
    }
    if activation_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    compiled = compile_decoder_layers(model, backend=compile_backend) if variant.compile else 0
    if wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        init_process_group(device)
        model = apply_data_parallel(
            model,
            mesh=init_device_mesh(device.type, (1,)),
            config=FSDP2Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
    optimizer = torch.optim.AdamW(
        param_groups(model, weight_decay=config.optim.weight_decay),
        lr=config.optim.lr,
        betas=config.optim.betas,
        eps=config.optim.eps,
        fused=True if variant.fused_adam else None,  # None: torch's default (foreach on CUDA)
    )
    engine = Engine(model, optimizer, max_grad_norm=config.optim.max_grad_norm)
    fused = fused_head(engine) is not None  # token_sum_loss takes train_recipes.loss.fused_loss

    # Host -> device copy of each batch, as the recipe's loop does it (timed separately).
    h2d: list[float] = []
    batches = []
    for b in cpu_batches:
        sync(device)
        t0 = time.perf_counter()
        batches.append(data_api.to_device(data_api.batch_tensors(b, vlm=True), device))
        sync(device)
        h2d.append(time.perf_counter() - t0)
    samples = [len(b.sample_weights) for b in cpu_batches]
    tokens = [int(b.attention_mask.sum()) for b in cpu_batches]

    # Packed rows take cp-sharder's variable-length attention at cp=1, as in the recipe.
    sharder = None
    if any(b.qkv_format == "thd" for b in cpu_batches):
        from torch.distributed.device_mesh import init_device_mesh

        from cp_sharder import ContextParallelSharder

        init_process_group(device)
        mesh = init_device_mesh(device.type, (1,))
        sharder = ContextParallelSharder(model, mesh, padding_token_id=0)

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The recipe's micro-step (gradient_accumulation_steps=1, one dp rank, cp=1), with its
        # host count of the trained tokens (counting on the device would wait for the GPU).
        num_tokens = engine.global_num_tokens(batch["num_trainable_tokens"])
        loss = token_sum_loss(
            engine, batch, sharder=sharder, vlm=True, trained_only=variant.trained_only
        )
        engine.backward(loss, num_tokens=num_tokens)
        engine.step()
        return loss.detach()

    times: list[float] = []
    losses: list[float] = []
    if compiled:
        # Each batch has its own shapes (tokens, patches, images): warm up on all of them, so
        # that no (re)compilation falls into the timed steps.
        warmup = max(warmup, len(batches))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    compile_s = 0.0
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        sync(device)
        t0 = time.perf_counter()
        loss = step(batch)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        elif compiled:
            compile_s += time.perf_counter() - t0
        losses.append(float(loss) / max(1, batch["num_trainable_tokens"]))
    if profile_path is not None:
        from sft_step import profile

        profile(step, batches, argparse.Namespace(device=device.type), profile_path)
    median_s = statistics.median(times)
    # Per-batch mean over the steps actually timed.
    timed = [(warmup + i) % len(batches) for i in range(steps)]
    mean_samples = statistics.fmean(samples[j] for j in timed)
    mean_tokens = statistics.fmean(tokens[j] for j in timed)
    mean_flops = {k: statistics.fmean(flops[j][k] for j in timed) for k in flops[0]}
    tflops_per_s = mean_flops["total"] / median_s / 1e12
    row = {
        "variant": f"step {variant.name}",
        "setup": (
            ("fsdp2 fp32 weights, bf16 compute" if wrap == "fsdp2" else dtype)
            + (", vision varlen" if variant.varlen else ", vision per window (stock)")
            + (", patch embedding matmul" if variant.linear_patch else ", patch embedding Conv3d")
            + (f", {compiled} blocks compiled ({compile_backend})" if compiled else "")
            + (", fused AdamW" if variant.fused_adam else ", AdamW (torch's default: foreach)")
            + (", fused loss" if fused else ", loss on logits")
            + (" over trained rows" if fused and variant.trained_only else "")
            + (", activation checkpointing" if activation_checkpointing else "")
            + f", {device.type}"
        ),
        "samples/s": mean_samples / median_s,
        "tokens/s": mean_tokens / median_s,
        "ms/batch": median_s * 1e3,
        "model TFLOP/batch": mean_flops["total"] / 1e12,
        "TFLOP/s": tflops_per_s,
        "MFU": tflops_per_s / peak_tflops,
        "TFLOP/batch by part": {k: v / 1e12 for k, v in mean_flops.items() if k != "total"},
        "first loss/token": losses[0],
        "fused loss": fused,
        "loss over trained rows only": fused and variant.trained_only,
        # K / (B*S): the share of the head's work the trained-rows loss keeps.
        "trained/positions": statistics.fmean(
            batches[j]["num_trainable_tokens"] / batches[j]["labels"].numel() for j in timed
        ),
        "compiled blocks": compiled,
        "samples/batch": mean_samples,
        "tokens/batch": mean_tokens,
        "images/batch": statistics.fmean(int(b.image_grid_thw.shape[0]) for b in cpu_batches),
        "batches": len(batches),
        "steps": steps,
        "warmup steps": warmup,
        "warm-up s (compiling)": compile_s if compiled else None,
        "min ms/step": min(times) * 1e3,
        "max ms/step": max(times) * 1e3,
        "h2d ms/batch": statistics.fmean(h2d) * 1e3,
        "peak GiB": peak_gib(device),
        "params (B)": n_params / 1e9,
        "loss/token first, last": [losses[0], losses[-1]],
    }
    if compiled:
        torch._dynamo.reset()  # the next variant's model must not reuse (or keep) these graphs
    return row, described


# ------------------------------------------------------------------------------------ main


def environment(device: torch.device, num_workers: int) -> dict[str, Any]:
    import transformers

    try:
        from megatron.energon import __version__ as energon_version
    except ImportError:  # pragma: no cover - energon is a dependency of energon-sft
        energon_version = None
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        **versions(),
        "transformers": transformers.__version__,
        "megatron_energon": str(energon_version),
        "device": str(device),
        "device_name": device_name(device),
        "num_workers": num_workers,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_threads": torch.get_num_threads(),
        "argv": sys.argv[1:],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--model", choices=sorted(PRESETS), default=None, help="model preset")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument(
        "--wrap",
        choices=["plain", "fsdp2"],
        default="plain",
        help="plain: the model in --dtype as is (the fastest step); fsdp2: fp32 weights under "
        "a 1-rank FSDP2 with bf16 compute and fp32 reduction (the recipe's GPU configs)",
    )
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument(
        "--step-only",
        action="store_true",
        help="measure only the step variants: no loader measurement, a small dataset "
        "(--num-samples 240), the first --step-batches batches, --warmup-steps 2 --steps 8",
    )
    parser.add_argument(
        "--step-variants",
        default=None,
        help="comma-separated, measured in this order in one process: stock (transformers' "
        "per-window vision attention) or varlen (one varlen call per vision block, the "
        "recipe's), then any of +linearpatch, +fusedadam, +compile, +fsdp2, +allpositions "
        "(the fused loss over every position, not the trained rows only) (default: "
        "varlen+linearpatch+fusedadam, the recipe's step on CUDA; "
        f"--step-only: {STEP_ONLY_VARIANTS}; --quick: stock,varlen)",
    )
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of +compile (inductor on CUDA, aot_eager on the CPU)",
    )
    parser.add_argument(
        "--profile",
        default="",
        help="step variants to profile, comma-separated (profile_<variant>.txt next to --out)",
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="MFU's peak (989: H100/H200 bf16 dense)"
    )
    parser.add_argument("--num-workers", type=int, default=None, help="loader workers (4)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="packed rows (2)")
    parser.add_argument("--max-length", type=int, default=None, help="pack capacity (4096)")
    parser.add_argument("--image-size", type=int, default=None, help="square side (448)")
    parser.add_argument("--image-format", choices=["jpeg", "png"], default="jpeg")
    parser.add_argument("--two-image-fraction", type=float, default=0.5)
    parser.add_argument("--num-samples", type=int, default=None, help="dataset size (2000)")
    parser.add_argument("--data-dir", default=None, help="keep/reuse the dataset here")
    parser.add_argument("--warmup-batches", type=int, default=None, help="max(8, 3*workers)")
    parser.add_argument("--batches", type=int, default=None, help="timed loader batches (100)")
    parser.add_argument("--step-batches", type=int, default=None, help="batches to step on (8)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="(3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (12)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (for CI)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    full = {
        "model": "qwen2.5-vl-3b",
        "num_workers": 4,
        "micro_batch_size": 2,
        "max_length": 4096,
        "image_size": 448,
        "num_samples": 2000,
        "batches": 100,
        "step_batches": 8,
        "warmup_steps": 3,
        "steps": 12,
        "step_variants": "varlen+linearpatch+fusedadam",
    }
    quick = {
        "model": "tiny",
        "num_workers": 1,
        "micro_batch_size": 2,
        "max_length": 1024,
        "image_size": 56,
        "num_samples": 48,
        "batches": 4,
        "step_batches": 2,
        "warmup_steps": 1,
        "steps": 2,
        "warmup_batches": 2,
        "step_variants": "stock,varlen",
    }
    defaults = quick if args.quick else full
    if args.step_only:
        # Enough samples for the step batches (~13 samples a batch at the full sizes); the
        # loader only delivers them. Fewer timed steps: seven variants in a few minutes.
        defaults = {**defaults, "warmup_batches": 0}
        if not args.quick:
            defaults |= {
                "num_samples": 240,
                "step_variants": STEP_ONLY_VARIANTS,
                "warmup_steps": 2,
                "steps": 8,
            }
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.step_only and args.batches < args.step_batches:
        args.batches = args.step_batches
    if args.warmup_batches is None:
        args.warmup_batches = max(8, 3 * args.num_workers)
    if args.compile_backend is None:
        args.compile_backend = "inductor" if args.device.startswith("cuda") else "aot_eager"
    args.variants = [StepVariant.parse(v) for v in args.step_variants.split(",") if v]
    if not args.variants:
        raise SystemExit("--step-variants names no variant")
    if args.model != "tiny" and args.device == "cpu":
        raise SystemExit(
            f"--model {args.model} needs --device cuda; use --quick or --model tiny on the CPU"
        )
    if args.step_batches > args.batches:
        raise SystemExit(f"--step-batches {args.step_batches} > --batches {args.batches}")
    return args


def sft_config(args: argparse.Namespace, dataset: Path) -> Any:
    """The recipe config this bench stands for (validated like `train-recipes sft` does)."""
    from train_recipes.config import (
        DataConfig,
        ModelConfig,
        ParallelConfig,
        SFTConfig,
        TinyModelConfig,
        TrainConfig,
        validate_sft,
    )

    text = PRESETS[args.model]["text"]
    fsdp = args.wrap == "fsdp2"
    config = SFTConfig(
        model=ModelConfig(
            tiny=TinyModelConfig(**text, tie_word_embeddings=True),
            dtype="float32" if fsdp else args.dtype,
            attn_implementation="sdpa",
        ),
        data=DataConfig(
            path=str(dataset),
            model_family="qwen2_5_vl",
            max_length=args.max_length,
            micro_batch_size=args.micro_batch_size,
            num_workers=args.num_workers,
            packing=True,
        ),
        parallel=ParallelConfig(data_parallel="fsdp2" if fsdp else "ddp"),
        train=TrainConfig(
            seed=args.seed, device="cuda" if args.device.startswith("cuda") else "cpu"
        ),
    )
    validate_sft(config, world_size=1)
    return config


def measure_variant(
    config: Any,
    processor: Any,
    kept: list[Any],
    args: argparse.Namespace,
    variant: StepVariant,
    device: torch.device,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One step variant; retried once with activation checkpointing when it runs out of memory."""
    logger.info("step %s: building the %s model on %s", variant.name, args.model, device)
    profile_path = None
    if variant.name in args.profile.split(","):
        if not args.out:
            raise SystemExit("--profile writes next to --out; pass --out")
        profile_path = Path(args.out).parent / f"profile_{variant.name}.txt"
    checkpointing = args.activation_checkpointing
    for attempt in range(2):
        oom = False
        try:
            row, described = measure_step(
                config,
                processor,
                PRESETS[args.model],
                kept,
                device=device,
                variant=variant,
                wrap=args.wrap,
                activation_checkpointing=checkpointing,
                warmup=args.warmup_steps,
                steps=args.steps,
                peak_tflops=args.peak_tflops,
                compile_backend=args.compile_backend,
                profile_path=profile_path,
            )
            break
        except torch.OutOfMemoryError:
            if checkpointing or attempt:
                raise
            oom = True
        if oom:  # outside the except block, so the failed attempt's frames are released
            torch._dynamo.reset()
            free_memory(device)
            logger.warning("step %s: out of memory; measuring with checkpointing", variant.name)
            checkpointing = True
    if checkpointing != args.activation_checkpointing:
        row["note"] = "out of memory without activation checkpointing; measured with it"
    free_memory(device)  # the variant's model and optimizer are gone with its frame
    return row, described


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    from train_recipes.config import to_dict

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # no CUDA call before the loader workers fork
    with tempfile.TemporaryDirectory(prefix="loader-vs-step-") as tmp:
        data_dir = Path(args.data_dir) if args.data_dir else Path(tmp)
        dataset, data_stats = write_dataset(
            data_dir,
            num_samples=args.num_samples,
            image_size=args.image_size,
            image_format=args.image_format,
            two_image_fraction=args.two_image_fraction,
            seed=args.seed,
        )
        config = sft_config(args, dataset)
        processor = build_processor(args.image_size)
        # The loader first: its workers start before anything touches CUDA.
        logger.info("loader: %d warm-up + %d timed batches", args.warmup_batches, args.batches)
        loader_row, kept = measure_loader(
            config,
            processor,
            warmup=args.warmup_batches,
            batches=args.step_batches if args.step_only else args.batches,
            keep=args.step_batches,
        )
    step_rows: list[dict[str, Any]] = []
    model_meta: dict[str, Any] = {}
    for variant in args.variants:
        row, model_meta = measure_variant(config, processor, kept, args, variant, device)
        step_rows.append(row)
        logger.info(
            "step %s: %.1f ms, MFU %.1f%%, first loss/token %.6f",
            variant.name,
            row["ms/batch"],
            100 * row["MFU"],
            row["first loss/token"],
        )
        if args.out:  # what a run stopped by a time limit leaves (the full JSON replaces it)
            write_json(args.out, {"partial": True, "loader": loader_row, "rows": step_rows})
    base = step_rows[0]
    for row in step_rows:
        row[f"vs {base['variant']}"] = base["ms/batch"] / row["ms/batch"]
    fastest = min(step_rows, key=lambda r: r["ms/batch"])
    ratio: dict[str, Any] | None = None
    if not args.step_only:
        ratio = {
            "step_variant": fastest["variant"],
            "samples_per_s": loader_row["samples/s"] / fastest["samples/s"],
            "tokens_per_s": loader_row["tokens/s"] / fastest["tokens/s"],
        }
        ratio["keeps_gpu_fed"] = ratio["samples_per_s"] >= 1.0
    rows = step_rows if args.step_only else [loader_row, *step_rows]
    meta = {
        **environment(device, args.num_workers),
        "model": {"preset": args.model, **model_meta},
        "dataset": {
            **data_stats,
            "image_size": args.image_size,
            "image_format": args.image_format,
            "image_tokens": (args.image_size // 28) ** 2,
        },
        "peak_tflops": args.peak_tflops,
        "sft_config": to_dict(config),
        "args": {k: v for k, v in vars(args).items() if k != "variants"},
    }
    title = (
        f"{args.model}, micro batch {args.micro_batch_size} packed rows of <= {args.max_length} "
        f"tokens, {args.image_size}px {args.image_format}, {meta['device_name']}"
    )
    if not args.step_only:
        print_table(
            rows,
            ["variant", "samples/s", "tokens/s", "ms/batch", "samples/batch", "tokens/batch"],
            title=f"energon-sft loader ({args.num_workers} workers) vs SFT step: {title}",
        )
    print_table(
        step_rows,
        [
            "variant",
            "ms/batch",
            f"vs {base['variant']}",
            "tokens/s",
            "model TFLOP/batch",
            "TFLOP/s",
            "MFU",
            "first loss/token",
            "peak GiB",
        ],
        title=f"SFT step variants (MFU against {args.peak_tflops:g} TFLOP/s): {title}",
    )
    for row in step_rows:
        print_lines(f"  {row['variant']}: {row['setup']}")
    if ratio is not None:
        verdict = "keeps the GPU fed" if ratio["keeps_gpu_fed"] else "does NOT keep the GPU fed"
        print(
            f"loader / step samples/s = {ratio['samples_per_s']:.3g} ({ratio['step_variant']}): "
            f"the loader {verdict}"
        )
    if args.out:
        payload = {"meta": meta, "rows": rows, "ratio": ratio}
        print_lines(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
