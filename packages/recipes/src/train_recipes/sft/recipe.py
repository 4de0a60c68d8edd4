"""The SFT recipe object: the stages that the loop calls.

energon-sft data -> (cp-sharder) -> HF causal LM -> vocab-parallel token-sum loss ->
train_engine.Engine (DDP or FSDP2).

# B batch, S sequence
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from train_recipes.config.loader import to_dict
from train_recipes.config.sft import SFTConfig
from train_recipes.data import energon_api as data_api
from train_recipes.data.colocated import replica_loader
from train_recipes.data.demo import sft_data_paths
from train_recipes.data.energon_api import ModelBatch
from train_recipes.data.plane import DataPlane, sample_ids_of
from train_recipes.data.processors import load_processor, tokenizer_of
from train_recipes.export.hf import export_hf
from train_recipes.loop import throughput
from train_recipes.loop.drive import LoopOutcome, LoopPlan, RunEnd, RunStart, StepRecord
from train_recipes.loop.health import (
    HangWatchdog,
    SkipTracker,
    default_store,
    engine_skip_warnings_replaced,
)
from train_recipes.loop.metrics import StartupClock, TokenMeter, TokenWindow
from train_recipes.loop.schedule import resolve_length
from train_recipes.loss.token_loss import token_sum_loss
from train_recipes.model import moe
from train_recipes.model.attention import (
    CausalFastPath,
    attention_path,
    rows_are_packed,
    sdpa_backends,
)
from train_recipes.model.build import is_vlm, unwrap
from train_recipes.model.parallelize import build_parallel_model, row_length_multiple
from train_recipes.run import checkpoints, runtime
from train_recipes.run.end_state import missing_end
from train_recipes.run.folder import (
    EXPORT_DIR,
    publish_dir,
    rank0_printer,
    record_config_changes,
    staging_dir,
)
from train_recipes.run.process_group import (
    describe_device,
    init_distributed,
    process_group_timeout_s,
)
from train_recipes.run.runtime import build_optimizer, open_run_folder, write_run_config
from train_recipes.sft.evaluation import SFTEvaluation
from train_recipes.sft.summary import attention_line, header_line

if TYPE_CHECKING:
    from train_engine import Engine, LossWindow
    from train_recipes.loop.schedule import Rebase

logger = logging.getLogger(__name__)

__all__ = ["SFTRecipe", "SFTResult"]


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


class SFTRecipe:
    """The SFT recipe on one rank, as stages that :func:`train_recipes.loop.drive.drive` calls.

    ``setup()`` builds the process groups, data, model, Engine and loader (and restores a
    checkpoint on resume); ``train_step(step)`` runs one optimizer step and returns a
    :class:`~train_recipes.loop.drive.StepRecord` of plain numbers (on the plan's log steps: loss,
    window average, lr, grad norm, token rate and counts, skips, MoE metrics; agreed over the
    ranks, so identical everywhere); ``evaluate(step)`` the held-out exact match (step 0) or
    held-out loss; ``checkpoint(step)`` saves; ``finish()`` measures the final exact match,
    exports and returns the summary. The object logs nothing itself. Use it as a context
    manager: the run's guards (hang watchdog, the Engine's skip-warning filter) end with it.

    Args:
        config: a validated config.
        resume: continue from the newest complete checkpoint (see :func:`run_sft`).
    """

    def __init__(self, config: SFTConfig, *, resume: bool = False) -> None:
        self.config = config
        self.resume = resume
        self._guards = contextlib.ExitStack()
        self._lines: list[str] = []  # console lines for the next record (skips)
        self._first_loss: float | None = None
        self._last_loss: float | None = None
        self._accuracy_before: float | None = None
        self._eval_losses: list[float] = []
        self._watchdog: HangWatchdog | None = None
        self._rebase: Rebase | None = None  # a resume's learning-rate correction, saved on

    def __enter__(self) -> SFTRecipe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._guards.close()

    @property
    def is_main(self) -> bool:
        """Rank 0 (valid after :meth:`setup`)."""
        return self.ctx.is_main

    # ------------------------------------------------------------------------------- setup

    def setup(self) -> RunStart:
        """Process groups, data, model, Engine, loader; the restored state on resume."""
        from train_engine import Engine, LossWindow

        config = self.config
        ctx = self.ctx = init_distributed(
            device_preference=config.train.device,
            cp=config.parallel.cp,
            tp=config.parallel.tp,
            timeout_s=process_group_timeout_s(config.train.collective_timeout_s),
        )
        config = self.config = resolve_length(config, dp=ctx.dp_size)  # epochs -> steps
        train = config.train
        self.vlm = is_vlm(config)
        clock = self._clock = StartupClock(enabled=ctx.is_main)
        self._device_line = describe_device(ctx.device)
        self._attention = (
            f"{attention_line(config)}; "
            f"{attention_path(packed=config.data.packing, cp=ctx.cp_size, vlm=self.vlm)}"
        )
        if ctx.is_main:
            print(header_line(ctx, config, self._device_line, self._attention), flush=True)
        clock.start("building data")
        out_dir = self.out_dir = open_run_folder(train.output_dir, is_main=ctx.is_main)
        torch.manual_seed(train.seed)
        dataset_path, eval_path = sft_data_paths(config, out_dir, is_main=ctx.is_main)
        processor = self.processor = load_processor(config)
        tokenizer = tokenizer_of(processor)
        if ctx.is_main:  # written whole: `train-recipes export` reads it
            processor.save_pretrained(staging := staging_dir(out_dir / "tokenizer"))
            publish_dir(staging, out_dir / "tokenizer")
        clock.start("building model")
        model = self.model = build_parallel_model(config, tokenizer, ctx, on_phase=clock.start)
        # Resolved once: the same choice builds the optimizer and is printed at the start.
        self._optimizer_choice = runtime.choose_optimizer(model, config.optim, device=ctx.device)
        optimizer, self._scheduler = build_optimizer(
            model,
            config.optim,
            device=ctx.device,
            total_steps=train.steps,
            choice=self._optimizer_choice,
        )
        self.engine: Engine = Engine(
            model,
            optimizer,
            self._scheduler,
            max_grad_norm=config.optim.max_grad_norm,
            nonfinite=config.optim.nonfinite,
            gradient_accumulation_steps=train.gradient_accumulation_steps,
            # Token counts are per data-parallel replica: a replica's cp ranks count the same.
            dp_group=ctx.mesh["dp"].get_group(),
        )
        self.sharder = None
        self._megatron = config.model.backend == "megatron"
        # Packed rows take cp-sharder's variable-length attention, at cp=1 as well (the megatron
        # backend's own attention reads the packed layout from PackedSeqParams instead).
        if not self._megatron and (ctx.cp_size > 1 or config.data.packing):
            from cp_sharder import ContextParallelSharder

            self.sharder = ContextParallelSharder(
                unwrap(model), ctx.mesh["cp"], padding_token_id=int(tokenizer.pad_token_id)
            )
        clock.start("building loader")
        self._encoder = data_api.build_encoder(
            processor,
            model_family=config.data.model_family,
            max_length=config.data.max_length,
            train_on=config.data.train_on,
            pad_to_multiple_of=row_length_multiple(config),
            packing=config.data.packing,
            overlong=config.data.overlong,
        )
        # One loader per replica, on its first rank; its cp/tp peers receive the batches.
        self.loader = replica_loader(config, ctx, dataset_path, encoder=self._encoder)
        self._guards.callback(self.loader.close)  # stopped at the end, not at interpreter exit
        self.data_plane = DataPlane(dp_size=ctx.dp_size)
        # The window's ranks hold disjoint parts of the loss sum (tp ranks hold copies).
        self.window: LossWindow = LossWindow(train.loss_window, group=ctx.grad_mesh().get_group())
        data = config.data
        self._skips = SkipTracker(
            train.max_consecutive_skips,
            on_skip=self._note_skip,
            no_token_hint=(
                f"check data.max_length={data.max_length} (a chat cut before its answer trains "
                f"nothing) and data.train_on={data.train_on!r}"
            ),
        )
        start = self._restore(out_dir)
        if start.finished:
            return start
        self._evaluation = SFTEvaluation(
            config,
            ctx,
            eval_path=eval_path,
            encoder=self._encoder,
            processor=processor,
            vlm=self.vlm,
            loss_sum=self._held_out_loss_sum,
        )
        clock.end()
        # Unpacked text without cp: causal SDPA without transformers' mask construction.
        self._fast_path = (
            CausalFastPath(model)
            if not (self.vlm or self._megatron) and self.sharder is None
            else None
        )
        self._router_losses = moe.router_losses(model, self.engine, config, ctx)
        self._batches = itertools.chain.from_iterable(itertools.repeat(self.loader))
        self._tokens = TokenMeter(duplicates=ctx.cp_size * ctx.tp_size)
        self._flops = throughput.model_counts(self._counted_model())
        self._peak_tflops = throughput.resolve_peak_tflops(train.peak_tflops, ctx.device)
        self._guards.enter_context(engine_skip_warnings_replaced())
        return start

    def _restore(self, out_dir: Path) -> RunStart:
        config, ctx = self.config, self.ctx
        optimizer_line = self._optimizer_choice.line
        train = config.train
        say = rank0_printer(ctx.is_main)
        restored = None
        if self.resume:
            restored = checkpoints.restore(
                self.engine,
                self.loader,
                self.window,
                config,
                dp_size=ctx.dp_size,
                is_main=ctx.is_main,
                say=say,
                data_plane=self.data_plane,
            )
        self._start_step = 0 if restored is None else restored.step
        if restored is not None:
            self._accuracy_before = restored.accuracy_before
            self._first_loss = restored.first_loss
            self._last_loss = restored.last_loss
            self._eval_losses = list(restored.eval_losses)
            self._rebase = restored.rebase
            if restored.skips is not None:
                self._skips.load_state_dict(restored.skips)
        plan = self._plan = LoopPlan(
            total_steps=train.steps,
            log_every=train.log_every,
            eval_every=train.eval_every,
            checkpoint_every=train.checkpoint_every,
            checkpoint_last=True,
        )
        missing = []
        if self._start_step == train.steps:  # trained; the end may have been interrupted
            missing = missing_end(out_dir, steps=train.steps, export=train.export)
        if self._start_step >= train.steps and not missing:
            say(
                f"{out_dir} finished at step {self._start_step} (train.steps={train.steps}); "
                "nothing to do"
            )
            return RunStart(
                output_dir=out_dir, plan=plan, start_step=self._start_step, finished=True
            )
        if missing:
            say(
                f"{out_dir} trained all {train.steps} steps but its end was interrupted: "
                f"finishing {' and '.join(missing)}"
            )
        # config.yaml says what trains from here on; the history, what changed when.
        write_run_config(out_dir, config, is_main=ctx.is_main)
        if ctx.is_main:
            changes = {} if restored is None else restored.changes
            record_config_changes(out_dir, step=self._start_step, changes=changes)
        return RunStart(
            output_dir=out_dir,
            plan=plan,
            start_step=self._start_step,
            desc=f"sft dp={ctx.dp_size} cp={ctx.cp_size} tp={ctx.tp_size}",
            tensorboard=train.tensorboard,
            loggers=train.loggers,
            run_config=to_dict(config),
            lines=(optimizer_line,)
            if restored is None
            else (optimizer_line, f"resumed from {restored.path} at step {self._start_step}"),
        )

    # -------------------------------------------------------------------------- train_step

    def train_step(self, step: int) -> StepRecord:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches."""
        config, ctx, engine = self.config, self.ctx, self.engine
        if step == self._start_step + 1:
            self._clock.start("first step")
            self._start_watchdog()
            self._tokens.restart_clock()
        if self._watchdog is not None:
            self._watchdog.enter_step(step)
        accum = config.train.gradient_accumulation_steps
        # Host copies: counts and layouts are read there (a device read stalls the GPU queue).
        raw = [next(self._batches) for _ in range(accum)]
        self.data_plane.record(step, ctx.dp_rank, [i for b in raw for i in sample_ids_of(b)])
        host = [data_api.batch_tensors(b, vlm=self.vlm, cp=ctx.cp_size) for b in raw]
        micro = [data_api.to_device(m, ctx.device) for m in host]
        # Contract (b): the window's loss tokens over all data-parallel replicas, from the
        # loader's count (made before cp sharding: a replica's cp ranks hold the same count).
        num_tokens = engine.global_num_tokens(sum(m["num_trainable_tokens"] for m in host))
        step_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
        router_losses = self._router_losses
        with sdpa_backends(config.model.sdpa_backends):
            for batch, host_batch in zip(micro, host, strict=True):
                self._tokens.add_inputs(
                    host_batch["attention_mask"],
                    flops=self._flops.batch_flops(host_batch)["total"],
                )
                with self._forward_attention(host_batch), router_losses.collect():
                    loss_sum = token_sum_loss(
                        engine,
                        batch,
                        sharder=self.sharder,
                        vlm=self.vlm,
                        chunk_tokens=self.config.model.fused_loss_chunk_tokens,
                        trained_only=self.config.model.fused_loss_trained_only,
                    )
                extra = router_losses.term(num_tokens)  # MoE aux/z losses (0.0 otherwise)
                engine.backward(loss_sum + extra, num_tokens=num_tokens)
                step_loss += loss_sum.detach().to(torch.float64)
                step_result = engine.step()
        self._skips.observe(step, step_result)  # the previous step's skip flag, settled by now
        if step == self._start_step + 1:
            self._clock.end()
        router_losses.after_step(ctx.device)  # DeepSeek bias balancing (no-op otherwise)
        self._tokens.add_loss_tokens(num_tokens)  # the Engine's global count, not a recount
        self.window.update(step_loss, num_tokens)
        if not self._plan.logs(step):
            return StepRecord(step=step, lines=self._take_lines())
        return StepRecord(step=step, metrics=self._step_metrics(), lines=self._take_lines())

    def _step_metrics(self) -> dict[str, Any]:
        """The metric record of a log step (collective: every rank reads the same numbers)."""
        ctx = self.ctx
        self._skips.flush()
        loss, avg = self.window.last(), self.window.average()
        window = self._tokens.read(ctx.device)
        self._first_loss = loss if self._first_loss is None else self._first_loss
        self._last_loss = loss
        record: dict[str, Any] = {
            "loss": loss,
            "loss_avg_window": avg,
            "lr": self._scheduler.get_last_lr()[0],
            "grad_norm": self.engine.get_global_grad_norm(),
            "tokens_per_s": window.tokens_per_s,
            "loss_tokens": window.loss_tokens,
            "skipped": self._skips.new_since_last_call(),
            "skipped_total": len(self._skips.skipped),
        }
        record.update(self._router_losses.metrics(ctx.device))  # collective; {} without MoE
        record.update(self._rates(window))
        return record

    def _rates(self, window: TokenWindow | None) -> dict[str, float]:
        """Tokens/s per GPU, MFU (with a known peak) and peak memory (CUDA); collective."""
        fields: dict[str, float] = {}
        if window is not None:
            fields |= throughput.rate_fields(
                tokens=window.tokens,
                flops=window.flops,
                seconds=window.seconds,
                devices=self.ctx.world_size,
                peak_tflops=self._peak_tflops,
            )
        memory = throughput.peak_memory_gib(self.ctx.device)
        if memory is not None:
            fields["peak_memory_gib"] = memory
        return fields

    def _run_rates(self) -> dict[str, float | None]:
        """The summary's rates and peak memory; None where not measured. Collective.

        The rates are those of the log windows after the first (``TokenMeter.run_window``).
        """
        rates = self._rates(self._tokens.run_window())
        keys = ("tokens_per_s_per_gpu", "mfu", "peak_memory_gib")
        return {**{k: rates.get(k) for k in keys}, "peak_tflops": self._peak_tflops}

    def _counted_model(self) -> torch.nn.Module:
        """The model whose weights the FLOP count reads (megatron: its HF config's, on meta)."""
        if not self._megatron:
            return unwrap(self.model)
        from transformers import AutoModelForCausalLM

        from train_recipes.megatron.recipe import hf_config

        with torch.device("meta"):
            model: torch.nn.Module = AutoModelForCausalLM.from_config(hf_config(self.model))
        return model

    def _forward_attention(self, host_batch: ModelBatch) -> contextlib.AbstractContextManager[None]:
        if self._fast_path is None:
            return contextlib.nullcontext()
        return self._fast_path.selected(packed=rows_are_packed(host_batch["position_ids"]))

    def _start_watchdog(self) -> None:
        store = default_store()
        if self.ctx.world_size > 1 and store is not None:
            self._watchdog = HangWatchdog(
                store,
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
                timeout_s=self.config.train.collective_timeout_s,
            ).start()
            self._guards.callback(self._watchdog.stop)

    def _note_skip(self, step: int, empty: bool) -> None:
        why = (
            "no trained token: every label of the step was masked"
            if empty
            else f"non-finite gradient norm, optim.nonfinite={self.config.optim.nonfinite!r}"
        )
        self._lines.append(f"step {step}: optimizer update skipped ({why})")

    def _take_lines(self) -> tuple[str, ...]:
        lines, self._lines = tuple(self._lines), []
        return lines

    # ---------------------------------------------------------------- evaluate, checkpoint

    def evaluate(self, step: int) -> StepRecord:
        """The held-out evaluation after ``step``.

        Step 0: exact match before training, and the held-out loss when ``train.eval_every``
        asks for it (the summary's "before"); later steps: the held-out loss.
        """
        metrics: dict[str, float] = {}
        lines: list[str] = []
        if step == 0:
            accuracy = self._exact_match()
            if accuracy is not None:
                self._accuracy_before = accuracy
                rows = len(self._evaluation.rows)
                lines.append(
                    f"held-out exact match before training: {accuracy:.1%} ({rows} questions)"
                )
                metrics["eval/exact_match"] = accuracy
            if self.config.train.eval_every == 0:
                return StepRecord(step=0, metrics=metrics, lines=tuple(lines))
        with self._tokens.paused(self.ctx.device):  # not training time (the rates leave it out)
            loss = self._evaluation.loss(unwrap(self.model))
        if loss is not None:
            self._eval_losses.append(loss)
            when = "before training" if step == 0 else f"step {step}"
            lines.append(f"held-out loss {when}: {loss:.4f}")
            metrics["eval/loss"] = loss
        return StepRecord(step=step, metrics=metrics, lines=tuple(lines))

    def _hf_model(self) -> torch.nn.Module:
        """Give the model to generate from.

        The HF model itself, or (megatron backend) an HF copy of the GPTModel's current weights
        (collective over tp; every rank holds all of it).
        """
        if not self._megatron:
            return unwrap(self.model)
        from train_recipes.megatron.recipe import hf_copy

        return hf_copy(self.model, device=self.ctx.device)

    def _exact_match(self) -> float | None:
        """Held-out exact match (collective), None without held-out rows."""
        if not self._evaluation.rows:
            return None
        return self._evaluation.exact_match(self._hf_model())

    def _held_out_loss_sum(self, batch: ModelBatch, host_batch: ModelBatch) -> Tensor:
        with self._forward_attention(host_batch), sdpa_backends(self.config.model.sdpa_backends):
            return token_sum_loss(unwrap(self.model), batch, sharder=self.sharder, vlm=self.vlm)

    def checkpoint(self, step: int) -> None:
        """Save the Engine, loader, loss window and run records of ``step`` (collective)."""
        self._skips.flush()  # the step's own skip goes into its checkpoint
        with self._tokens.paused(self.ctx.device):  # not training time
            checkpoints.save(
                self.engine,
                self.out_dir,
                step=step,
                loader=self.loader,
                window=self.window,
                config=self.config,
                dp_size=self.ctx.dp_size,
                accuracy_before=self._accuracy_before,
                first_loss=self._first_loss,
                is_main=self.ctx.is_main,
                data_plane=self.data_plane,
                last_loss=self._last_loss,
                eval_losses=self._eval_losses,
                skips=self._skips.state_dict(),
                rebase=self._rebase,
            )

    # ------------------------------------------------------------------------------ finish

    def finish(self) -> RunEnd:
        """Final exact match and HF export (collective); the summary."""
        ctx, train = self.ctx, self.config.train
        self._skips.flush()
        self._skips.check_trained(train.steps)  # on every rank: the skips are agreed
        if self._watchdog is not None:
            self._watchdog.stop()  # from here on, rank 0 alone writes plots and files
        metrics: dict[str, Any] = {}
        self._accuracy_after = self._exact_match()
        if self._accuracy_after is not None:
            metrics["eval/exact_match"] = self._accuracy_after
        export_dir = None
        if train.export:  # written beside, then moved in whole
            staging = staging_dir(self.out_dir / EXPORT_DIR, clear=ctx.is_main)
            written = export_hf(
                self._hf_model() if self._megatron else self.model,
                self.processor,
                staging,
                is_main=ctx.is_main,
                lora_export=self.config.lora.export,
            )
            if written is not None:
                export_dir = publish_dir(written, self.out_dir / EXPORT_DIR)
        summary = {
            "steps": train.steps,
            "first_loss": self._first_loss,
            "last_loss": self._last_loss,
            "accuracy_before": self._accuracy_before,
            "accuracy_after": self._accuracy_after,
            "world_size": ctx.world_size,
            "dp": ctx.dp_size,
            "cp": ctx.cp_size,
            "tp": ctx.tp_size,
            "skipped_steps": self._skips.skipped,
            "eval_loss_first": self._eval_losses[0] if self._eval_losses else None,
            "eval_loss_last": self._eval_losses[-1] if self._eval_losses else None,
            "device": self._device_line,
            "attention": self._attention,
            "startup_s": self._clock.phases,
            **self._run_rates(),
        }
        record = StepRecord(step=train.steps, metrics=metrics, lines=self._take_lines())
        return RunEnd(record=record, summary=summary, export_dir=export_dir)

    def result(self, outcome: LoopOutcome) -> SFTResult:
        """The run's :class:`SFTResult` after :func:`drive` returned ``outcome``."""
        train = self.config.train
        trained = outcome.end is not None  # False: a finished run, resumed, trained nothing
        return SFTResult(
            output_dir=self.out_dir,
            steps=train.steps if trained else self._start_step,
            first_loss=self._first_loss,
            last_loss=self._last_loss if trained else None,
            accuracy_before=self._accuracy_before,
            accuracy_after=self._accuracy_after if trained else None,
            export_dir=self.out_dir / EXPORT_DIR if trained and train.export else None,
            model=unwrap(self.model),
            data_plane=self.data_plane,
            loaders_built=self.loader.loaders_built,
        )
