"""The SFT recipe: energon-sft data -> (cp-sharder) -> HF causal LM -> vocab-parallel token-sum
loss -> train_engine.Engine (DDP or FSDP2), with metrics, checkpoints, resume and HF export.

# B batch, S sequence, S_l local (cp-sharded) sequence, V vocabulary
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import Tensor

from train_recipes import _integrations as data_api
from train_recipes import moe
from train_recipes._dist import RankContext, engine_dp_config, init_distributed
from train_recipes.config import SFTConfig, to_dict
from train_recipes.metrics import RunLogger, plot_loss
from train_recipes.modeling import (
    CausalFastPath,
    apply_lora,
    apply_output_tp,
    build_model,
    compile_decoder_layers,
    exact_match_accuracy,
    export_hf,
    is_vlm,
    load_processor,
    rows_are_packed,
    sdpa_backends,
    tokenizer_of,
    unwrap,
)

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
EXPORT_DIR = "hf_model"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(kw_only=True, slots=True, frozen=True)
class SFTResult:
    """What a finished run reports (identical on every rank).

    Attributes:
        output_dir: the run directory.
        steps: optimizer steps done in total.
        first_loss: the loss of the first logged step of this process.
        last_loss: the loss of the last step.
        accuracy_before: held-out exact match before training (None when not measured).
        accuracy_after: held-out exact match after training.
        export_dir: the Hugging Face export, when written.
        model: the trained model (unwrapped from DDP; FSDP2 models stay sharded).
    """

    output_dir: Path
    steps: int
    first_loss: float | None
    last_loss: float | None
    accuracy_before: float | None
    accuracy_after: float | None
    export_dir: Path | None
    model: torch.nn.Module


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (saves are atomic: a listed one is whole)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    ]
    return max(found)[1] if found else None


def _prune_checkpoints(output_dir: Path, keep: int) -> None:
    root = output_dir / CHECKPOINT_DIR
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
    for _, path in found[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


def _lr_lambda(config: SFTConfig) -> Any:
    warmup, total, floor = config.optim.warmup_steps, config.train.steps, config.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return max(floor, 1.0 - (1.0 - floor) * progress)

    return factor


def _prepare_data(config: SFTConfig, ctx: RankContext, out_dir: Path) -> tuple[Path, Path | None]:
    """The Energon dataset path and the held-out JSONL (rank 0 writes the demo; others wait)."""
    if config.data.path is not None:
        eval_path = Path(config.data.eval_path) if config.data.eval_path else None
        return Path(config.data.path), eval_path
    from train_recipes.demo import write_demo_dataset

    data_dir = out_dir / "data"
    if ctx.is_main:
        write_demo_dataset(
            data_dir,
            task=config.data.demo,
            train_size=config.data.demo_train_size,
            eval_size=config.data.demo_eval_size,
            seed=config.train.seed,
        )
    dist.barrier()
    return data_dir / "energon", data_dir / "eval.jsonl"


def _forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def token_sum_loss(
    model: Any, batch: dict[str, Tensor], *, sharder: Any = None, vlm: bool = False
) -> Tensor:
    """The sum over this rank's trained tokens of -log p(label): the loss of contract (b).

    Text batches pass ``position_ids`` and no attention mask: right padding never reaches a
    real token under causal attention, and for packed rows transformers derives the document
    boundaries from the restarting position ids (no attention across packed samples). VLM
    batches do the same with [4, B, S] position ids (the 1-D ids, from which transformers
    derives the packed-document mask, then the M-RoPE ids built per packed part) and the
    images; the model's own M-RoPE builder would treat a packed row as one sequence.
    With a ``sharder`` (cp > 1) the batch is cp-sharded and the forward runs in its context.

    Args:
        model: the (wrapped) model or the Engine.
        batch: ``input_ids`` [B, S], ``labels`` [B, S] (already shifted, -100 untrained),
            ``position_ids`` [B, S], ``attention_mask`` [B, S] (+ ``mrope_position_ids``
            [3, B, S] and, when the batch has images, ``pixel_values`` [P, D] and
            ``image_grid_thw`` [N, 3] for VLM; see ``batch_tensors``).

    Returns:
        0-dim float32 tensor.
    """
    from vocab_parallel import token_log_probs

    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    if vlm:
        if "mrope_position_ids" not in batch:
            raise ValueError(
                "a VLM batch needs mrope_position_ids [3, B, S]; build the batch with "
                "batch_tensors(batch, device, spatial_merge_size=...)"
            )
        inputs["position_ids"] = torch.cat(
            [batch["position_ids"].unsqueeze(0), batch["mrope_position_ids"]]
        )
        for name in ("pixel_values", "image_grid_thw"):  # absent for a text-only batch
            if name in batch:
                inputs[name] = batch[name]
    elif "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
    # No KV cache: transformers only derives packed-document masks from position ids when
    # there is no cache, and training never reuses one anyway.
    if sharder is None:
        labels = inputs.pop("labels")
        logits = model(**inputs, use_cache=False).logits  # [B, S, V]
        return -token_log_probs(logits, labels).sum()
    train_ctx, local = sharder.shard(inputs)
    labels = local.pop("labels")
    with train_ctx():
        logits = model(**local, use_cache=False).logits  # [B, S_l, V]
        return -token_log_probs(logits, labels).sum()


def run_sft(config: SFTConfig, *, resume: bool = False) -> SFTResult:
    """Run the SFT recipe on the already-launched ranks (or one process).

    Args:
        config: a validated config.
        resume: continue from the newest checkpoint in ``train.output_dir`` (fresh start when
            there is none).

    Returns:
        The run summary, identical on every rank.
    """
    from train_engine import Engine, LossWindow, apply_data_parallel, param_groups

    train = config.train
    ctx = init_distributed(
        device_preference=train.device, cp=config.parallel.cp, tp=config.parallel.tp
    )
    out_dir = Path(train.output_dir)
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    torch.manual_seed(train.seed)

    dataset_path, eval_path = _prepare_data(config, ctx, out_dir)
    processor = load_processor(config)
    tokenizer = tokenizer_of(processor)
    if ctx.is_main:
        processor.save_pretrained(out_dir / "tokenizer")
    model = apply_lora(build_model(config, tokenizer), config).to(ctx.device)
    model.train()
    if config.model.compile:
        compile_decoder_layers(model)
    if ctx.tp_size > 1:
        model = apply_output_tp(model, ctx.mesh["tp"])
    expert_shards = moe.prepare(model, ctx, config)  # MoE: converted, experts sharded over ep
    model = apply_data_parallel(
        model,
        mesh=ctx.grad_mesh(),
        config=engine_dp_config(config.parallel),
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        expert_shards=expert_shards,
    )
    optimizer = torch.optim.AdamW(
        param_groups(model, weight_decay=config.optim.weight_decay),
        lr=config.optim.lr,
        betas=config.optim.betas,
        fused=ctx.device.type == "cuda" if config.optim.fused is None else config.optim.fused,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config))
    engine = Engine(
        model,
        optimizer,
        scheduler,
        max_grad_norm=config.optim.max_grad_norm,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        # Token counts are per data-parallel replica: cp ranks of a replica count the same tokens.
        dp_group=ctx.mesh["dp"].get_group(),
    )
    sharder = None
    if ctx.cp_size > 1:
        from cp_sharder import ContextParallelSharder

        sharder = ContextParallelSharder(
            unwrap(model), ctx.mesh["cp"], padding_token_id=int(tokenizer.pad_token_id)
        )
    encoder = data_api.build_encoder(
        processor,
        model_family=config.data.model_family,
        max_length=config.data.max_length,
        train_on=config.data.train_on,
        pad_to_multiple_of=2 * ctx.cp_size,
        packing=config.data.packing,
    )
    # cp ranks of one replica build identical loaders (same dp rank, same seed): same batches.
    loader = data_api.build_loader(
        dataset_path,
        encoder=encoder,
        batch_size=config.data.micro_batch_size,
        dp_rank=ctx.dp_rank,
        dp_world_size=ctx.dp_size,
        num_workers=config.data.num_workers,
        seed=train.seed,
        shuffle=config.data.shuffle,
        num_logical_shards=config.data.num_logical_shards,
    )

    start_step = 0
    accuracy_before: float | None = None
    ckpt = latest_checkpoint(out_dir) if resume else None
    if ckpt is not None:
        extra = engine.load_checkpoint(ckpt)
        loader.load_state_dict(extra["loader"])
        start_step = int(extra["step"])
        accuracy_before = extra.get("accuracy_before")
    eval_rows: list[dict[str, Any]] = []
    if eval_path is not None and train.eval_samples > 0:
        from train_recipes.demo import read_jsonl

        eval_rows = list(read_jsonl(eval_path))[: train.eval_samples]
    run_log = RunLogger(
        out_dir,
        enabled=ctx.is_main,
        total_steps=train.steps,
        start_step=start_step,
        tensorboard=train.tensorboard,
        desc=f"sft dp={ctx.dp_size} cp={ctx.cp_size} tp={ctx.tp_size}",
    )
    if ckpt is not None:
        run_log.write(f"resumed from {ckpt} at step {start_step}")
    if eval_rows and start_step == 0:
        accuracy_before = exact_match_accuracy(
            unwrap(model),
            processor,
            eval_rows,
            max_new_tokens=train.eval_max_new_tokens,
            device=ctx.device,
            media_root=eval_path.parent if eval_path is not None else None,
            tp=ctx.tp_size,
        )
        run_log.write(
            f"held-out exact match before training: {accuracy_before:.1%} ({len(eval_rows)} questions)"
        )
        run_log.log(0, {"eval/exact_match": accuracy_before})

    vlm = is_vlm(config)
    # One placeholder token per merge x merge patches (the image processor's setting, which
    # also decided how many placeholders the loader wrote).
    merge = int(processor.image_processor.merge_size) if vlm else None
    # Text without cp: unpacked batches skip transformers' device-side packing check.
    fast_path = CausalFastPath(model) if not vlm and sharder is None else None
    window = LossWindow(train.loss_window)
    router_losses = moe.router_losses(model, engine, config, ctx)
    batches = _forever(loader)
    accum = train.gradient_accumulation_steps
    first_loss: float | None = None
    last_loss: float | None = None
    seen = torch.zeros(2, dtype=torch.float64)  # [loss tokens, input tokens] since the last log
    t_last = time.perf_counter()
    for step in range(start_step + 1, train.steps + 1):
        # Counted on the host copies: reading device tensors would stall the GPU's queue.
        host = [
            data_api.batch_tensors(next(batches), torch.device("cpu"), spatial_merge_size=merge)
            for _ in range(accum)
        ]
        local_tokens = sum(int((m["labels"] != -100).sum()) for m in host)
        micro = [{k: v.to(ctx.device, non_blocking=True) for k, v in m.items()} for m in host]
        # Contract (b): the window's loss tokens over all data-parallel replicas (counted before
        # cp sharding, so every cp rank of a replica holds the same count).
        num_tokens = engine.global_num_tokens(local_tokens)
        step_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
        with sdpa_backends(config.model.sdpa_backends):
            for batch, host_batch in zip(micro, host, strict=True):
                seen[1] += float(host_batch["attention_mask"].sum()) / (ctx.cp_size * ctx.tp_size)
                if fast_path is not None:
                    fast_path.select(packed=rows_are_packed(host_batch["position_ids"]))
                with router_losses.collect():
                    loss_sum = token_sum_loss(engine, batch, sharder=sharder, vlm=vlm)
                extra = router_losses.term(num_tokens)  # MoE aux/z losses (0.0 otherwise)
                engine.backward(loss_sum + extra, num_tokens=num_tokens)
                step_loss += loss_sum.detach().to(torch.float64)
                engine.step()
        router_losses.after_step(ctx.device)  # DeepSeek bias balancing (no-op otherwise)
        # The cp and tp ranks of a replica count the same tokens: summed over all ranks at
        # logging time, this is the global number of loss tokens.
        seen[0] += local_tokens / (ctx.cp_size * ctx.tp_size)
        # Each rank holds a part of the global token sum; scaled so the mean over all ranks is
        # the exact global token-mean loss.
        # (tp ranks hold the same value, hence the division by tp.)
        window.update(
            step_loss
            * (ctx.world_size / ctx.tp_size)
            / num_tokens.to(step_loss.device, torch.float64)
        )
        if step % train.log_every == 0 or step == train.steps:
            loss = window.last()
            avg = window.average()
            totals = seen.clone().to(ctx.device)
            dist.all_reduce(totals)
            now = time.perf_counter()
            tokens_per_s = float(totals[1]) / max(now - t_last, 1e-9)
            t_last = now
            seen.zero_()
            lr = scheduler.get_last_lr()[0]
            grad_norm = engine.get_global_grad_norm()
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
            record = {
                "loss": loss,
                "loss_avg_window": avg,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_s,
                "loss_tokens": float(totals[0]),
            }
            record.update(router_losses.metrics(ctx.device))  # collective; {} without MoE
            run_log.log(step, record)
            run_log.progress(
                step,
                {
                    "loss": f"{loss:.4f}",
                    "avg": f"{avg:.4f}",
                    "tok/s": f"{tokens_per_s:.0f}",
                    "lr": f"{lr:.2e}",
                },
            )
        if train.checkpoint_every and step % train.checkpoint_every == 0 and step < train.steps:
            engine.save_checkpoint(
                out_dir / CHECKPOINT_DIR / f"step_{step:06d}",
                extra_state={
                    "loader": loader.state_dict(),
                    "step": step,
                    "accuracy_before": accuracy_before,
                },
            )
            if ctx.is_main:
                _prune_checkpoints(out_dir, train.keep_checkpoints)
            dist.barrier()

    if fast_path is not None:
        # Generation (padding masks, KV cache) and the HF export need transformers' own SDPA.
        fast_path.select(packed=True)
    accuracy_after: float | None = None
    if eval_rows:
        accuracy_after = exact_match_accuracy(
            unwrap(model),
            processor,
            eval_rows,
            max_new_tokens=train.eval_max_new_tokens,
            device=ctx.device,
            media_root=eval_path.parent if eval_path is not None else None,
            tp=ctx.tp_size,
        )
        run_log.log(train.steps, {"eval/exact_match": accuracy_after})
    export_dir = None
    if train.export:
        export_dir = export_hf(
            model,
            processor,
            out_dir / EXPORT_DIR,
            is_main=ctx.is_main,
            lora_export=config.lora.export,
        )
    run_log.close()
    result = SFTResult(
        output_dir=out_dir,
        steps=train.steps,
        first_loss=first_loss,
        last_loss=last_loss,
        accuracy_before=accuracy_before,
        accuracy_after=accuracy_after,
        export_dir=out_dir / EXPORT_DIR if train.export else None,
        model=unwrap(model),
    )
    if ctx.is_main:
        png = plot_loss(out_dir)
        summary = {
            "steps": train.steps,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "accuracy_before": accuracy_before,
            "accuracy_after": accuracy_after,
            "world_size": ctx.world_size,
            "dp": ctx.dp_size,
            "cp": ctx.cp_size,
            "tp": ctx.tp_size,
        }
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(_summary_table(summary, out_dir, png, export_dir), flush=True)
    dist.barrier()
    return result


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def _summary_table(
    summary: dict[str, Any], out_dir: Path, png: Path, export_dir: Path | None
) -> str:
    acc0, acc1 = summary["accuracy_before"], summary["accuracy_after"]
    lines = [
        "",
        f"run            {out_dir}",
        f"ranks          {summary['world_size']} "
        f"(dp={summary['dp']}, cp={summary['cp']}, tp={summary['tp']})",
        f"steps          {summary['steps']}",
        f"loss           {_fmt(summary['first_loss'])} -> {_fmt(summary['last_loss'])}",
    ]
    if acc0 is not None and acc1 is not None:
        lines.append(f"exact match    {acc0:.1%} -> {acc1:.1%} (held-out, greedy)")
    lines.append(f"loss curve     {png}")
    if export_dir is not None:
        lines.append(f"HF export      {export_dir}")
    return "\n".join(lines)
