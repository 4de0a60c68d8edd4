"""End-to-end SFT step on one GPU: the train-recipes path against two plain FSDP2 loops.

Model: Llama-style, hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192, vocab
128256, untied head (1.50B parameters), random init, batch 4 x 4096 tokens. Every variant uses
FSDP2 mixed precision (bf16 compute, fp32 master weights, fp32 gradient reduction), fused
AdamW and clipping at 1.0, and runs in the same process one after the other:

- ``fsdp2``: a hand-written loop, the transformers model as is (its loss upcasts the logits).
- ``fsdp2+compile``: the same with each decoder layer compiled.
- ``recipes``: the train-recipes step: Engine (fused AdamW: clipping and the non-finite skip
  inside the kernel, no host sync), compiled decoder layers, the token-sum loss through
  vocab-parallel's fused linear cross-entropy (no logits; ``recipes-logits-loss``: on bf16
  logits instead), unsharded parameters kept between forward and backward (one GPU), causal
  attention without transformers' mask construction for unpacked rows (no host sync), and the
  SDPA backend order of ``--sdpa`` (cuDNN first by default).
- ``recipes-*``: ablations, each undoing one of these; ``recipes-cp1`` runs ``recipes-hf-mask``
  through cp-sharder at cp=1 (compare the two for the sharder's cost).
- ``recipes-lean``: ``recipes`` with the compiled layers under the activation memory budget
  ``--lean-budget`` (the recipe's ``model.compile_memory_budget``; 0.9 makes the layers
  recompute the norms' outputs and the SwiGLU product in backward instead of saving them, on
  the CPU and the H200 alike: ``saved_activations.py``); ``recipes-lean-reshard``: the same
  with reshard; ``recipes-lean-chunk``: ``recipes-lean`` with ``--lean-loss-chunk`` tokens per
  chunk of the fused loss (the recipe's ``model.fused_loss_chunk_tokens``: fewer passes over
  the head's gradient for a larger transient at the end of forward).
- ``recipes-master``: ``recipes-lean-chunk`` without FSDP2: the model's parameters in bf16,
  the fp32 master weights in train-engine's ``MasterWeightAdamW`` (the same fp32-master
  arithmetic; one kernel reads the bf16 gradients and writes master, moments and the bf16
  parameters, where one-rank FSDP2 copies the parameters in and the gradients out each step).
- ``fsdp2+liger``: the ``fsdp2`` loop with Liger-Kernel patched into transformers' Llama
  (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy); needs ``liger-kernel`` (the bench
  group) and always runs last, because the patches stay for the rest of the process.
- ``amp+vp`` / ``amp+liger``: the loop HF Trainer runs with ``bf16=True`` (fp32 parameters,
  no FSDP2, the forward under ``torch.autocast`` in bf16, fused AdamW, clipping), eager
  transformers layers; the loss either through the recipe's ``token_sum_loss`` (vocab-parallel's
  fused linear cross-entropy on the fp32 hidden states and head weight: fp32 gradients) or
  through Liger-Kernel's fused linear cross-entropy patched into the model (only that patch, so
  the two differ in the loss alone; runs after every variant without Liger, before
  ``fsdp2+liger``). On the CPU the forward runs in fp32 (no autocast), as the others do.

Exactness: before timing, each variant's first forward and backward (same initial weights,
same batch) is compared with an fp32 eager reference of the unwrapped transformers model
(``_step_check``): the relative error of the loss per token and the worst relative error of
eight parameters' gradients, printed and written next to the variant's time (``--no-check``
skips it; the reference needs the memory of an fp32 step once, before the variants).

Model FLOPs: ``train_recipes.loop.throughput``, the count the recipe reports MFU with (6 x the
matmul weights per token, embedding excluded, plus causal attention per row); MFU is against
the dense bf16 peak given by ``--peak-tflops`` (989 for H100/H200 SXM).
``--board`` samples the GPU's power draw and SM clock during each variant's timed steps (a step
held at the board's power limit runs below its top clock).

    python packages/recipes/bench/sft_step.py --out sft_step.json
    python packages/recipes/bench/sft_step.py --variants recipes --profile recipes
    python packages/recipes/bench/sft_step.py --quick      # tiny model on the CPU (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import _step_check
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from train_engine import Engine, FSDP2Config, MasterWeightAdamW, apply_data_parallel, param_groups
from train_recipes.loop.throughput import model_counts
from train_recipes.model.attention import CausalFastPath, sdpa_backends
from train_recipes.model.build import compile_decoder_layers
from train_recipes.sft.run import token_sum_loss

# `device_name`, `free_memory`, `init_process_group`, `sync`, FULL and TINY stay importable from
# here for the benchmarks next to this one.
from train_testing.bench import (
    LLAMA_1P5B,
    LLAMA_TINY,
    add_sft_step_arguments,
    board_samples,
    device_name,
    fmt,
    free_memory,
    init_process_group,
    llama_config,
    peak_gib,
    print_lines,
    resolve_sft_step_sizes,
    sync,
    versions,
    write_json,
)
from train_testing.tiny_hf import parameters_to
from vocab_parallel import token_log_probs

FULL = LLAMA_1P5B
TINY = LLAMA_TINY


@dataclass(kw_only=True, slots=True, frozen=True)
class Variant:
    """One way of running the step (see the module docstring)."""

    name: str
    engine: bool
    compile: bool
    # "hf": transformers' loss on the logits; "vocab_parallel": the recipe's token_sum_loss
    # (fused linear cross-entropy, no logits); "logits": vocab-parallel on materialised logits
    loss: str
    reshard_after_forward: bool | None
    sdpa: tuple[str, ...] | None
    position_ids: bool = True  # the recipe passes them (packed rows need them)
    fast_path: bool = False  # the recipe's CausalFastPath for unpacked batches
    cp1: bool = False  # through cp-sharder's ContextParallelSharder on a 1-rank cp mesh
    liger: bool = False  # Liger-Kernel patched into transformers' Llama (a peer; runs last)
    memory_budget: float | None = None  # the compiled layers' activation memory budget
    loss_chunk: int | None = None  # tokens per chunk of the fused loss (None: its default)
    # bf16 parameters on the device, fp32 master weights in train-engine's MasterWeightAdamW,
    # no FSDP2 (on one GPU its copy-in and copy-out are all it adds)
    master_weights: bool = False
    # fp32 parameters, forward under bf16 autocast, plain loop without FSDP2 (HF Trainer's AMP)
    amp: bool = False

    @property
    def liger_order(self) -> int:
        """0: no Liger; 1: only its fused linear loss patched; 2: all its Llama patches. The
        patches stay for the rest of the process, so variants run in this order."""
        return 0 if not self.liger else 1 if self.amp else 2


def variants(args: argparse.Namespace) -> dict[str, Variant]:
    sdpa = tuple(args.sdpa.split(",")) if args.sdpa else None
    plain = Variant(
        name="fsdp2", engine=False, compile=False, loss="hf", reshard_after_forward=None, sdpa=None
    )
    recipes = Variant(
        name="recipes",
        engine=True,
        compile=True,
        loss="vocab_parallel",
        reshard_after_forward=False,
        sdpa=sdpa,
        fast_path=True,
    )
    out = [
        plain,
        replace(plain, name="fsdp2+compile", compile=True),
        recipes,
        # Ablations of the recipes step, one change each.
        replace(recipes, name="recipes-hf-loss", loss="hf"),
        replace(recipes, name="recipes-logits-loss", loss="logits"),
        replace(recipes, name="recipes-reshard", reshard_after_forward=True),
        replace(recipes, name="recipes-hf-mask", fast_path=False),
        replace(recipes, name="recipes-cp1", fast_path=False, cp1=True),
        replace(recipes, name="recipes-default-sdpa", sdpa=None),
        replace(recipes, name="recipes-eager", compile=False),
        # Fewer saved activations: the compiled layers recompute cheap ops in backward.
        replace(recipes, name="recipes-lean", memory_budget=args.lean_budget),
        replace(
            recipes,
            name="recipes-lean-reshard",
            memory_budget=args.lean_budget,
            reshard_after_forward=True,
        ),
        replace(
            recipes,
            name="recipes-lean-chunk",
            memory_budget=args.lean_budget,
            loss_chunk=args.lean_loss_chunk,
        ),
        replace(
            recipes,
            name="recipes-master",
            memory_budget=args.lean_budget,
            loss_chunk=args.lean_loss_chunk,
            reshard_after_forward=None,
            master_weights=True,
        ),
        # Liger's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy, patched into the
        # transformers classes for the rest of the process: always run last.
        replace(plain, name="fsdp2+liger", liger=True),
        # HF Trainer's AMP loop, the loss through vocab-parallel or through Liger's patch.
        replace(plain, name="amp+vp", loss="vocab_parallel", amp=True),
        replace(plain, name="amp+liger", liger=True, amp=True),
    ]
    return {v.name: v for v in out}


def build_model(args: argparse.Namespace) -> Any:
    from transformers import LlamaForCausalLM

    config = llama_config(TINY if args.quick else FULL, max_len=args.seq)
    torch.manual_seed(0)
    with torch.device(args.device):
        return LlamaForCausalLM(config)


def make_batches(args: argparse.Namespace, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        positions = torch.arange(args.seq).expand(args.batch, -1)
        # token_sum_loss takes labels already shifted (-100 where nothing is trained); the
        # transformers loss shifts by itself. Both train the same S - 1 tokens per row.
        shifted = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], dim=1)
        out.append(
            {
                "input_ids": ids.to(args.device),
                "labels": ids.to(args.device),
                "shifted_labels": shifted.to(args.device),
                "position_ids": positions.contiguous().to(args.device),
            }
        )
    return out


@dataclass(kw_only=True, slots=True, frozen=True)
class Step:
    """One variant's training step, in its two halves (the exactness check reads in between)."""

    forward_backward: Callable[[dict], torch.Tensor]  # returns the loss per trained token
    update: Callable[[], None]  # clipping, optimizer step, gradients cleared
    model: Any  # the wrapped model (for its gradients)

    def __call__(self, batch: dict[str, torch.Tensor]) -> None:
        self.forward_backward(batch)
        self.update()


def setup(variant: Variant, args: argparse.Namespace) -> tuple[Step, int, Any]:
    """Build model, optimizer and the step of one variant."""
    if variant.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        if variant.amp:  # the loss alone: the AMP pair differs in nothing else
            apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False)
        else:
            apply_liger_kernel_to_llama()
    model = build_model(args)
    config = model.config
    n_params = sum(p.numel() for p in model.parameters())
    # The benchmark's rows are not packed; without the variant's fast path, transformers' mask.
    fast_path = CausalFastPath(model)
    attention = partial(fast_path.selected, packed=not variant.fast_path)
    bf16 = torch.bfloat16 if args.device == "cuda" else torch.float32
    if variant.master_weights:
        # The masters start from these, as from a bf16 checkpoint (fp32 on the CPU, like the
        # other variants' compute there); the rotary tables stay fp32, as from_pretrained
        # leaves them.
        parameters_to(model, bf16)
    if variant.compile:
        compile_decoder_layers(model, memory_budget=variant.memory_budget)
    mesh = init_device_mesh(args.device, (1,))
    fused = args.device == "cuda"
    if variant.engine:
        opt: torch.optim.Optimizer
        if variant.master_weights:
            opt = MasterWeightAdamW(param_groups(model, weight_decay=0.1), lr=1e-5)
        else:
            fsdp = FSDP2Config(
                param_dtype=bf16,
                reduce_dtype=torch.float32,
                reshard_after_forward=variant.reshard_after_forward,
            )
            model = apply_data_parallel(model, mesh=mesh, config=fsdp)
            opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-5, fused=fused)
        engine = Engine(model, opt, max_grad_norm=1.0)
        sharder = None
        if variant.cp1:
            from cp_sharder import ContextParallelSharder

            sharder = ContextParallelSharder(model, mesh, padding_token_id=0)

        num_tokens = args.batch * (args.seq - 1)

        def forward_backward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            if variant.loss == "hf":
                with attention():
                    loss = engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                engine.backward(loss)
                return loss.detach()
            else:
                inputs = {"input_ids": batch["input_ids"], "labels": batch["shifted_labels"]}
                if variant.position_ids:
                    inputs["position_ids"] = batch["position_ids"]
                with attention():
                    if variant.loss == "logits":
                        labels = inputs.pop("labels")
                        logits = engine(**inputs, use_cache=False).logits
                        loss = -token_log_probs(logits, labels).sum()
                    else:
                        loss = token_sum_loss(
                            engine, inputs, sharder=sharder, chunk_tokens=variant.loss_chunk
                        )
                engine.backward(loss, num_tokens=num_tokens)
                return loss.detach() / num_tokens

        return (
            Step(forward_backward=forward_backward, update=engine.step, model=model),
            n_params,
            config,
        )

    if not variant.amp:
        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return _plain_step(model, variant, args), n_params, config


def _plain_step(model: Any, variant: Variant, args: argparse.Namespace) -> Step:
    """The hand-written loop: forward, backward, clipping and fused AdamW. With ``variant.amp``
    (HF Trainer's ``bf16=True``) the fp32 model's forward runs under bf16 autocast (fp32 on the
    CPU) and backward outside it; else the model is already FSDP2-wrapped in mixed precision."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device == "cuda")
    autocast = partial(
        torch.autocast,
        args.device,
        dtype=torch.bfloat16,
        enabled=variant.amp and args.device == "cuda",
    )
    num_tokens = args.batch * (args.seq - 1)

    def forward_backward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast():
            if variant.loss == "hf":  # Liger's fused linear loss when patched: the mean
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            else:
                inputs = {
                    "input_ids": batch["input_ids"],
                    "labels": batch["shifted_labels"],
                    "position_ids": batch["position_ids"],
                }
                loss = token_sum_loss(model, inputs) / num_tokens
        loss.backward()
        return loss.detach()

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Step(forward_backward=forward_backward, update=update, model=model)


def timed_steps(
    step: Callable[[dict], None], data: list[dict], args: argparse.Namespace
) -> list[float]:
    """Per-step seconds: CUDA events between steps, read after the last step (the host never
    waits between steps, as in training); wall clock on the CPU."""
    if args.device != "cuda":
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            step(data[i % 2])
            times.append(time.perf_counter() - t0)
        return times
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    events[0].record()
    for i in range(args.steps):
        step(data[i % 2])
        events[i + 1].record()
    events[-1].synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)]


def run_variant(
    variant: Variant,
    args: argparse.Namespace,
    out_dir: Path | None,
    ref: _step_check.Reference | None,
) -> dict[str, Any]:
    step, n_params, config = setup(variant, args)
    data = make_batches(args, config.vocab_size)
    with sdpa_backends(variant.sdpa):
        check = {}
        if ref is not None:  # the first step, from the initial weights, on the first batch
            loss = step.forward_backward(data[0])
            check = _step_check.errors(step.model, loss, ref)
            step.update()
        warmup_s = warm_up(step, data, args)
        board: dict[str, object] = {}
        sampling = (
            board_samples(board)
            if args.board and args.device == "cuda"
            else contextlib.nullcontext()
        )
        with sampling:
            times = timed_steps(step, data, args)
        if variant.name in (args.profile or "").split(",") and out_dir is not None:
            profile(step, data, args, out_dir / f"profile_{variant.name}.txt")
    row = {**result_row(variant.name, times, warmup_s, n_params, config, args), **check}
    return {**row, "board": board} if board else row


def warm_up(step: Callable[[dict], None], data: list[dict], args: argparse.Namespace) -> float:
    """Seconds of ``args.warmup`` untimed steps; the CUDA peak-memory counter restarts after."""
    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(data[i % 2])
    sync(args.device)
    warmup_s = time.perf_counter() - t0
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return warmup_s


def step_flops(config: Any, *, batch: int, seq: int) -> float:
    """Model FLOPs of a step of ``batch`` unpacked rows of ``seq`` tokens (the recipe's count)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model_counts(model).batch_flops({"attention_mask": torch.ones(batch, seq)})["total"]


def result_row(
    name: str,
    times: list[float],
    warmup_s: float,
    n_params: int,
    config: Any,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The JSON row of one variant from its timed step seconds (median over ``times``)."""
    seconds = statistics.median(times)
    tokens_per_s = args.batch * args.seq / seconds
    tflops = step_flops(config, batch=args.batch, seq=args.seq) / seconds / 1e12
    return {
        "variant": name,
        "ms/step": seconds * 1e3,
        "tokens/s": tokens_per_s,
        "model TFLOP/s": tflops,
        "MFU %": 100 * tflops / args.peak_tflops,
        "peak GiB": peak_gib(args.device),
        "warm-up s": warmup_s,
        "params (B)": n_params / 1e9,
    }


def print_summary(title: str, rows: list[dict[str, Any]], base: dict[str, Any]) -> None:
    """Add each row's throughput relative to ``base`` and print the table under ``title``."""
    for r in rows:
        r[f"vs {base['variant']}"] = r["tokens/s"] / base["tokens/s"]
    columns = [
        "variant",
        "ms/step",
        "tokens/s",
        "model TFLOP/s",
        "MFU %",
        f"vs {base['variant']}",
        "peak GiB",
        "warm-up s",
        "loss rel err",
        "grad rel err",
    ]
    print_lines(
        title, *("  ".join(f"{c}={fmt(r.get(c), none='None')}" for c in columns) for r in rows)
    )


def profile(
    step: Callable[[dict], None], data: list[dict], args: argparse.Namespace, path: Path
) -> None:
    """Kernel table of two steps, then where the GPU sat idle between kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        for i in range(2):
            step(data[i % 2])
        sync(args.device)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    text = prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70)
    if cuda:
        trace = path.with_suffix(".trace.json")
        prof.export_chrome_trace(str(trace))
        text += "\n" + idle_gaps(json.loads(trace.read_text()))
        trace.unlink()
    path.write_text(text)


def idle_gaps(trace: dict[str, Any], top: int = 25) -> str:
    """The GPU's idle time between consecutive kernels and copies, with the largest gaps and
    the CPU operation that was running when the next kernel was launched."""
    events = trace.get("traceEvents", [])
    gpu = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    if not gpu:
        return "no GPU events in the trace"
    launches = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("cat") == "cuda_runtime" and "args" in e
    }
    cpu_ops = sorted(
        (e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e),
        key=lambda e: e["ts"],
    )
    gaps = []
    end = gpu[0]["ts"] + gpu[0].get("dur", 0)
    for e in gpu[1:]:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e))
        end = max(end, e["ts"] + e.get("dur", 0))
    span = end - gpu[0]["ts"]
    idle = sum(g for g, _, _ in gaps)
    lines = [
        f"GPU span {span / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms ({100 * idle / span:.1f}%) "
        f"in {len(gaps)} gaps; largest:"
    ]
    for gap, at, e in sorted(gaps, key=lambda g: -g[0])[:top]:
        launch = launches.get(e.get("args", {}).get("correlation"))
        owner = "?"
        if launch is not None:
            # The innermost CPU op enclosing the launch call.
            enclosing = [c for c in cpu_ops if c["ts"] <= launch["ts"] <= c["ts"] + c["dur"]]
            if enclosing:
                owner = " < ".join(c["name"][:40] for c in enclosing[-3:][::-1])
        lines.append(
            f"  {gap / 1e3:7.2f} ms at +{(at - gpu[0]['ts']) / 1e3:7.1f} ms before "
            f"{e['name'][:50]!r} launched in {owner}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sft_step_arguments(parser)
    parser.add_argument("--variants", default="fsdp2,fsdp2+compile,recipes")
    parser.add_argument(
        "--sdpa", default="cudnn,flash", help="SDPA backend order of the recipes step"
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument(
        "--lean-budget",
        type=float,
        default=0.9,
        help="activation memory budget of the recipes-lean* variants' compiled layers",
    )
    parser.add_argument(
        "--lean-loss-chunk",
        type=int,
        default=4096,
        help="tokens per chunk of the recipes-lean-chunk variant's fused loss",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="variants to profile, comma-separated (tables in --out's folder)",
    )
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="skip the exactness check of each variant against the fp32 reference",
    )
    parser.add_argument(
        "--board",
        action="store_true",
        help="sample the GPU's power draw and SM clock (nvidia-smi) during each variant's timed "
        "steps; each JSON row gets a `board` summary",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, CPU is fine (no compile)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    resolve_sft_step_sizes(args)
    init_process_group(args.device)
    table = variants(args)
    chosen = [table[name] for name in args.variants.split(",")]
    chosen.sort(key=lambda v: v.liger_order)  # its patches stay: after every other variant
    if args.device != "cuda":
        # Inductor on the CPU needs a C++ toolchain; the quick run checks the plumbing only.
        chosen = [replace(v, compile=False) for v in chosen]
    out_dir = Path(args.out).parent if args.out else None
    ref = None
    if not args.no_check:
        # Before any variant: Liger's patches would reach the reference model too.
        vocab = llama_config(TINY if args.quick else FULL, max_len=args.seq).vocab_size
        ref = _step_check.reference(partial(build_model, args), make_batches(args, vocab)[0])
        free_memory(args.device)
    rows = []
    traced: object = "none yet"
    for variant in chosen:
        if variant.compile and (variant.sdpa, variant.memory_budget) != traced:
            # The SDPA backend and the saved activations are fixed while tracing: retrace when
            # the backend order or the memory budget changes.
            torch._dynamo.reset()
            traced = (variant.sdpa, variant.memory_budget)
        rows.append(run_variant(variant, args, out_dir, ref))
        free_memory(args.device)
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["variant"] == "fsdp2+compile"), rows[0])
    print_summary(
        f"\nSFT step, batch {args.batch} x {args.seq} ({device_name(args.device)})", rows, base
    )
    if args.out:
        meta = {
            **versions(),
            "device_name": device_name(args.device),
            **{k: v for k, v in vars(args).items() if k != "out"},
        }
        write_json(args.out, {"meta": meta, "rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
