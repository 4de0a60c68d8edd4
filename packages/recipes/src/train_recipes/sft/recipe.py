"""The SFT recipe object: the stages that the loop calls.

energon-sft data -> (cp-sharder) -> HF causal LM -> vocab-parallel token-sum loss ->
train_engine.Engine (DDP or FSDP2).

# B batch, S sequence
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from train_recipes.config.sft import SFTConfig
from train_recipes.data.energon_api import ModelBatch, is_vlm
from train_recipes.data.plane import DataPlane
from train_recipes.data.processors import tokenizer_of
from train_recipes.export.hf import export_hf
from train_recipes.loop.hang_watchdog import HangWatchdog
from train_recipes.loop.metrics import StartupClock, TokenMeter
from train_recipes.loop.records import LoopOutcome, RunEnd, RunStart, StepRecord
from train_recipes.model import moe
from train_recipes.model.attention import (
    CausalFastPath,
    attention_path,
    sdpa_backends,
)
from train_recipes.model.build import unwrap
from train_recipes.model.parallelize import build_parallel_model
from train_recipes.run import checkpoints
from train_recipes.run.folder import (
    EXPORT_DIR,
    publish_dir,
    rank0_printer,
    staging_dir,
)
from train_recipes.run.health import SkipTracker, engine_skip_warnings_replaced
from train_recipes.run.process_group import (
    describe_device,
    init_distributed,
    process_group_timeout_s,
)
from train_recipes.run.runtime import open_run_folder
from train_recipes.run.schedule import resolve_length
from train_recipes.sft.build import build_data, build_loader, build_training
from train_recipes.sft.evaluation import SFTEvaluation
from train_recipes.sft.rates import StepRates
from train_recipes.sft.start import loop_plan, run_start
from train_recipes.sft.step import SFTTrainStep
from train_recipes.sft.summary import SFTResult, attention_line, header_line

if TYPE_CHECKING:
    from train_engine import Engine, LossWindow
    from train_recipes.run.schedule import Rebase

logger = logging.getLogger(__name__)

__all__ = ["SFTRecipe"]


class SFTRecipe(SFTTrainStep):
    """The SFT recipe on one rank, as stages that :func:`train_recipes.loop.drive.drive` calls.

    ``setup()`` builds the process groups, data, model, Engine and loader (and restores a
    checkpoint on resume); ``train_step(step)`` runs one optimizer step and returns a
    :class:`~train_recipes.loop.records.StepRecord` of plain numbers (on the plan's log steps: loss,
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
        from train_engine import LossWindow

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
        data = build_data(config, out_dir, is_main=ctx.is_main)
        processor = self.processor = data.processor
        clock.start("building model")
        model = self.model = build_parallel_model(
            config, tokenizer_of(processor), ctx, on_phase=clock.start
        )
        training = build_training(config, ctx, model, pad_token_id=data.pad_token_id)
        self.engine: Engine = training.engine
        self._scheduler = training.scheduler
        self._optimizer_choice = training.optimizer_choice
        self.sharder = training.sharder
        self._loss = training.loss
        self._megatron = config.model.backend == "megatron"
        clock.start("building loader")
        self._encoder, self.loader = build_loader(config, ctx, data)
        self._guards.callback(self.loader.close)  # stopped at the end, not at interpreter exit
        self.data_plane = DataPlane(dp_size=ctx.dp_size)
        # The window's ranks hold disjoint parts of the loss sum (tp ranks hold copies).
        self.window: LossWindow = LossWindow(train.loss_window, group=ctx.grad_mesh().get_group())
        self._skips = SkipTracker(
            train.max_consecutive_skips,
            on_skip=self._note_skip,
            no_token_hint=(
                f"check data.max_length={config.data.max_length} (a chat cut before its answer "
                f"trains nothing) and data.train_on={config.data.train_on!r}"
            ),
        )
        start = self._restore(out_dir)
        if start.finished:
            return start
        self._evaluation = SFTEvaluation(
            config,
            ctx,
            eval_path=data.eval_path,
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
        self._rates = StepRates.of(
            model, megatron=self._megatron, peak_tflops=train.peak_tflops, ctx=ctx
        )
        self._guards.enter_context(engine_skip_warnings_replaced())
        return start

    def _restore(self, out_dir: Path) -> RunStart:
        config, ctx = self.config, self.ctx
        optimizer_line = self._optimizer_choice.line
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
        plan = self._plan = loop_plan(config)
        return run_start(
            config,
            ctx,
            out_dir,
            plan=plan,
            start_step=self._start_step,
            restored=restored,
            optimizer_line=optimizer_line,
        )

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
            return self._loss(unwrap(self.model), batch)

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
            **self._rates.run_summary(self._tokens),
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
