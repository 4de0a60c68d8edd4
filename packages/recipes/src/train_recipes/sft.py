"""The SFT recipe: energon-sft data -> (cp-sharder) -> HF causal LM -> vocab-parallel token-sum
loss -> train_engine.Engine (DDP or FSDP2), with metrics, checkpoints, resume and HF export.

# B batch, S sequence, S_l local (cp-sharded) sequence, V vocabulary
"""

from __future__ import annotations

import contextlib
import json
import logging
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
from train_recipes import resume as checkpoints
from train_recipes._dist import (
    RankContext,
    describe_device,
    init_distributed,
    process_group_timeout_s,
)
from train_recipes.attention import CausalFastPath, attention_path, rows_are_packed, sdpa_backends
from train_recipes.colocated import ColocatedLoader
from train_recipes.config_loader import to_dict
from train_recipes.config_sft import SFTConfig
from train_recipes.data_plane import DataPlane, sample_ids_of
from train_recipes.evaluation import held_out_batches, held_out_loss
from train_recipes.exact_match import exact_match_accuracy
from train_recipes.health import (
    HangWatchdog,
    SkipTracker,
    default_store,
    engine_skip_warnings_replaced,
)
from train_recipes.hf_export import export_hf
from train_recipes.metrics import RunLogger, StartupClock, loss_plot_or_notice
from train_recipes.modeling import is_vlm, unwrap
from train_recipes.parallelize import build_parallel_model
from train_recipes.processors import load_processor, tokenizer_of
from train_recipes.run_folder import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    EXPORT_DIR,
    publish_dir,
    rank0_printer,
    record_config_changes,
    staging_dir,
    write_atomic,
)
from train_recipes.schedule import build_lr_scheduler, resolve_length
from train_recipes.summary import attention_line, header_line, summary_table

logger = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_DIR", "EXPORT_DIR", "SFTResult", "run_sft", "token_sum_loss"]


@dataclass(kw_only=True, slots=True, frozen=True)
class SFTResult:
    """What a finished run reports (identical on every rank).

    Attributes:
        output_dir: the run directory.
        steps: optimizer steps done in total.
        first_loss: the loss of the first logged step of the run (also across resumes).
        last_loss: the loss of the last step.
        accuracy_before: held-out exact match before training (None when not measured).
        accuracy_after: held-out exact match after training.
        export_dir: the Hugging Face export, when written.
        model: the trained model (unwrapped from DDP; FSDP2 models stay sharded).
        data_plane: the samples each step trained on (this rank's replica; with ``--resume``,
            the earlier steps' too).
        loaders_built: energon-sft loaders this rank built (1 on a replica's first rank, else 0).
    """

    output_dir: Path
    steps: int
    first_loss: float | None
    last_loss: float | None
    accuracy_before: float | None
    accuracy_after: float | None
    export_dir: Path | None
    model: torch.nn.Module
    data_plane: DataPlane | None = None
    loaders_built: int = 0


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
    model: Any, batch: dict[str, Any], *, sharder: Any = None, vlm: bool = False
) -> Tensor:
    """The sum over this rank's trained tokens of -log p(label): the loss of contract (b).

    Unpacked text rows pass ``position_ids`` and no attention mask: right padding never reaches
    a real token under causal attention (energon-sft's padding positions continue the row, so
    they never read as a new document). Packed rows (``qkv_format == "thd"``) go through the
    ``sharder``, at cp=1 too: cp-sharder's variable-length attention keeps every document to
    itself, from ``seq_lens``, and no ``[S, S]`` mask is built. VLM batches pass [4, B, S]
    position ids (the 1-D ids, then the loader's M-RoPE ids, per packed document) and the
    images; the model's own M-RoPE builder would treat a packed row as one sequence. With a
    ``sharder`` the batch is sharded (cp > 1: over the cp ranks) and the forward runs in its
    context.

    Args:
        model: the (wrapped) model or the Engine.
        batch: ``input_ids`` [B, S], ``labels`` [B, S] (already shifted, -100 untrained),
            ``position_ids`` [B, S]; packed: ``qkv_format`` and ``seq_lens`` [B, N]; VLM:
            ``mrope_position_ids`` [3, B, S] and, when the batch has images, ``pixel_values``
            [P, D] and ``image_grid_thw`` [N, 3] (see ``_integrations.batch_tensors``).
        sharder: cp-sharder's ``ContextParallelSharder``; required for packed batches.
        vlm: the batch is an image-text batch (it must carry M-RoPE ids).

    Returns:
        0-dim float32 tensor.
    """
    from vocab_parallel import token_log_probs

    inputs: dict[str, Any] = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    if vlm:
        if "mrope_position_ids" not in batch:
            raise ValueError(
                "a VLM batch needs mrope_position_ids [3, B, S] (energon-sft builds them for "
                "M-RoPE families); build the batch with _integrations.batch_tensors(batch, vlm=True)"
            )
        inputs["position_ids"] = torch.cat(
            [batch["position_ids"].unsqueeze(0), batch["mrope_position_ids"]]
        )
        for name in ("pixel_values", "image_grid_thw"):  # absent for a text-only batch
            if name in batch:
                inputs[name] = batch[name]
    elif "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
    if batch.get("qkv_format") == "thd":
        if sharder is None:
            raise ValueError(
                "a packed batch (qkv_format='thd') needs cp-sharder's sharder (its "
                "variable-length attention keeps documents apart); pass sharder=..."
            )
        inputs["qkv_format"] = "thd"
        inputs["seq_lens"] = batch["seq_lens"]
    # No KV cache: training never reuses one.
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
        resume: continue from the newest complete checkpoint in ``train.output_dir`` (a clean
            start, with a message, when there is none; a finished run returns at once). The
            caller checks the folder first (``run_folder.check_output_dir``, under its lock).

    Returns:
        The run summary, identical on every rank.

    Raises:
        TrainingAborted: on every rank, e.g. after ``train.max_consecutive_skips`` skips.
    """
    # The loop's guards (hang watchdog thread, log filter) end with the run, however it ends.
    with contextlib.ExitStack() as guards:
        return _run_sft(config, resume=resume, guards=guards)


def _run_sft(config: SFTConfig, *, resume: bool, guards: contextlib.ExitStack) -> SFTResult:
    from train_engine import Engine, LossWindow, param_groups

    ctx = init_distributed(
        device_preference=config.train.device,
        cp=config.parallel.cp,
        tp=config.parallel.tp,
        timeout_s=process_group_timeout_s(config.train.collective_timeout_s),
    )
    config = resolve_length(config, dp=ctx.dp_size)  # train.epochs -> train.steps
    train = config.train
    clock = StartupClock(enabled=ctx.is_main)
    device_line = describe_device(ctx.device)
    attention = (
        f"{attention_line(config)}; "
        f"{attention_path(packed=config.data.packing, cp=ctx.cp_size, vlm=is_vlm(config))}"
    )
    if ctx.is_main:
        print(header_line(ctx, config, device_line, attention), flush=True)
    clock.start("building data")
    out_dir = Path(train.output_dir)
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(train.seed)

    dataset_path, eval_path = _prepare_data(config, ctx, out_dir)
    processor = load_processor(config)
    tokenizer = tokenizer_of(processor)
    if ctx.is_main:  # written whole: `train-recipes export` reads it
        processor.save_pretrained(staging := staging_dir(out_dir / "tokenizer"))
        publish_dir(staging, out_dir / "tokenizer")
    clock.start("building model")
    model = build_parallel_model(config, tokenizer, ctx, on_phase=clock.start)
    optimizer = torch.optim.AdamW(
        param_groups(model, weight_decay=config.optim.weight_decay),
        lr=config.optim.lr,
        betas=config.optim.betas,
        fused=ctx.device.type == "cuda" if config.optim.fused is None else config.optim.fused,
    )
    scheduler = build_lr_scheduler(optimizer, config.optim, total_steps=train.steps)
    engine = Engine(
        model,
        optimizer,
        scheduler,
        max_grad_norm=config.optim.max_grad_norm,
        nonfinite=config.optim.nonfinite,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        # Token counts are per data-parallel replica: cp ranks of a replica count the same tokens.
        dp_group=ctx.mesh["dp"].get_group(),
    )
    vlm = is_vlm(config)
    packed = config.data.packing
    sharder = None
    # Packed rows take cp-sharder's variable-length attention, at cp=1 as well.
    if ctx.cp_size > 1 or packed:
        from cp_sharder import ContextParallelSharder

        sharder = ContextParallelSharder(
            unwrap(model), ctx.mesh["cp"], padding_token_id=int(tokenizer.pad_token_id)
        )
    clock.start("building loader")
    encoder = data_api.build_encoder(
        processor,
        model_family=config.data.model_family,
        max_length=config.data.max_length,
        train_on=config.data.train_on,
        pad_to_multiple_of=2 * ctx.cp_size,
        packing=config.data.packing,
    )
    # One loader per replica, on its first rank; its cp/tp peers receive the batches.
    loader = ColocatedLoader(
        lambda: data_api.build_loader(
            dataset_path,
            encoder=encoder,
            batch_size=config.data.micro_batch_size,
            dp_rank=ctx.dp_rank,
            dp_world_size=ctx.dp_size,
            num_workers=config.data.num_workers,
            seed=train.seed,
            shuffle=config.data.shuffle,
            num_logical_shards=config.data.num_logical_shards,
        ),
        ctx=ctx,
        num_logical_shards=config.data.num_logical_shards,
    )
    data_plane = DataPlane(dp_size=ctx.dp_size)

    window = LossWindow(train.loss_window)
    say = rank0_printer(ctx.is_main)  # before the progress bar exists
    restored = (
        checkpoints.restore(
            engine,
            loader,
            window,
            config,
            dp_size=ctx.dp_size,
            is_main=ctx.is_main,
            say=say,
            data_plane=data_plane,
        )
        if resume
        else None
    )
    start_step = 0 if restored is None else restored.step
    accuracy_before = None if restored is None else restored.accuracy_before
    first_loss = None if restored is None else restored.first_loss
    if start_step >= train.steps:
        say(f"{out_dir} finished at step {start_step} (train.steps={train.steps}); nothing to do")
        dist.barrier()
        return SFTResult(
            output_dir=out_dir,
            steps=start_step,
            first_loss=first_loss,
            last_loss=None,
            accuracy_before=accuracy_before,
            accuracy_after=None,
            export_dir=None,
            model=unwrap(model),
            data_plane=data_plane,
            loaders_built=loader.loaders_built,
        )
    if ctx.is_main:  # config.yaml says what trains from here on; the history, what changed when
        write_atomic(out_dir / CONFIG_FILE, yaml.safe_dump(to_dict(config), sort_keys=False))
        record_config_changes(
            out_dir, step=start_step, changes={} if restored is None else restored.changes
        )
    eval_rows: list[dict[str, Any]] = []
    if eval_path is not None and train.eval_samples > 0:
        from train_recipes.demo import read_jsonl

        eval_rows = list(read_jsonl(eval_path))[: train.eval_samples]
    held_out: list[dict[str, Tensor]] = []
    if train.eval_every > 0 and eval_path is not None:
        from train_recipes.demo import read_jsonl

        held_out = held_out_batches(
            encoder,
            list(read_jsonl(eval_path))[: train.eval_loss_samples],
            batch_size=config.data.micro_batch_size,
            replica=ctx.dp_rank,
            replicas=ctx.dp_size,
            media_root=eval_path.parent,
            vlm=vlm,
            cp=ctx.cp_size,
        )
    clock.end()
    run_log = RunLogger(
        out_dir,
        enabled=ctx.is_main,
        total_steps=train.steps,
        start_step=start_step,
        tensorboard=train.tensorboard,
        desc=f"sft dp={ctx.dp_size} cp={ctx.cp_size} tp={ctx.tp_size}",
        loggers=train.loggers,
        run_config=to_dict(config),
    )
    guards.callback(run_log.close_bar)  # an aborted run's error line must not land in the bar
    if restored is not None:
        run_log.write(f"resumed from {restored.path} at step {start_step}")
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

    # Unpacked text without cp: causal SDPA without transformers' mask construction.
    fast_path = CausalFastPath(model) if not vlm and sharder is None else None
    router_losses = moe.router_losses(model, engine, config, ctx)
    batches = _forever(loader)
    accum = train.gradient_accumulation_steps
    last_loss: float | None = None
    seen = torch.zeros(2, dtype=torch.float64)  # [loss tokens, input tokens] since the last log

    def eval_loss_sum(batch: dict[str, Tensor], host_batch: dict[str, Tensor]) -> Tensor:
        if fast_path is not None:
            fast_path.select(packed=rows_are_packed(host_batch["position_ids"]))
        with sdpa_backends(config.model.sdpa_backends):
            return token_sum_loss(unwrap(model), batch, sharder=sharder, vlm=vlm)

    eval_loss: list[float] = []
    guards.enter_context(engine_skip_warnings_replaced())
    skips = SkipTracker(
        train.max_consecutive_skips,
        on_skip=lambda s: run_log.write(
            f"step {s}: optimizer update skipped (non-finite gradient norm, "
            f"optim.nonfinite={config.optim.nonfinite!r})"
        ),
    )
    store = default_store()
    if ctx.world_size > 1 and store is not None:
        watchdog = HangWatchdog(
            store,
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout_s=train.collective_timeout_s,
        ).start()
        guards.callback(watchdog.stop)
    else:
        watchdog = None
    clock.start("first step")
    t_last = time.perf_counter()
    for step in range(start_step + 1, train.steps + 1):
        if watchdog is not None:
            watchdog.enter_step(step)
        # Counted on the host copies: reading device tensors would stall the GPU's queue.
        raw = [next(batches) for _ in range(accum)]
        data_plane.record(step, ctx.dp_rank, [i for b in raw for i in sample_ids_of(b)])
        host = [data_api.batch_tensors(b, vlm=vlm, cp=ctx.cp_size) for b in raw]
        local_tokens = sum(int((m["labels"] != -100).sum()) for m in host)
        micro = [data_api.to_device(m, ctx.device) for m in host]
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
                step_result = engine.step()
        skips.observe(step, step_result)  # the previous step's skip flag, settled by now
        if step == start_step + 1:
            clock.end()
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
            skips.flush()
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
                "skipped": skips.new_since_last_call(),
                "skipped_total": len(skips.skipped),
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
        if held_out and (step % train.eval_every == 0 or step == train.steps):
            eval_loss.append(
                held_out_loss(
                    unwrap(model),
                    held_out,
                    loss_sum=eval_loss_sum,
                    device=ctx.device,
                    cp=ctx.cp_size,
                    tp=ctx.tp_size,
                )
            )
            run_log.log(step, {"eval/loss": eval_loss[-1]})
            run_log.write(f"step {step}: eval/loss {eval_loss[-1]:.4f} (held-out)")
        # The last step is always saved: the trained weights never depend on train.export.
        if step == train.steps or (train.checkpoint_every and step % train.checkpoint_every == 0):
            checkpoints.save(
                engine,
                out_dir,
                step=step,
                loader=loader,
                window=window,
                config=config,
                dp_size=ctx.dp_size,
                accuracy_before=accuracy_before,
                first_loss=first_loss,
                is_main=ctx.is_main,
                data_plane=data_plane,
            )

    skips.flush()
    if watchdog is not None:
        watchdog.stop()  # from here on, rank 0 alone writes plots and files
    run_log.close_bar()
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
    if train.export:  # written beside, then moved in whole
        staging = staging_dir(out_dir / EXPORT_DIR, clear=ctx.is_main)
        written = export_hf(
            model, processor, staging, is_main=ctx.is_main, lora_export=config.lora.export
        )
        if written is not None:
            export_dir = publish_dir(written, out_dir / EXPORT_DIR)
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
        data_plane=data_plane,
        loaders_built=loader.loaders_built,
    )
    if ctx.is_main:
        png = loss_plot_or_notice(out_dir)
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
            "skipped_steps": skips.skipped,
            "eval_loss_first": eval_loss[0] if eval_loss else None,
            "eval_loss_last": eval_loss[-1] if eval_loss else None,
            "device": device_line,
            "attention": attention,
            "startup_s": clock.phases,
        }
        write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2))
        print(summary_table(summary, out_dir, png, export_dir), flush=True)
    dist.barrier()
    return result
