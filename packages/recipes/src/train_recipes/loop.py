"""The training loop of every recipe, written once: what happens at step k, and who logs it.

A recipe object (:class:`RecipeStages`: ``setup``, ``train_step``, ``evaluate``,
``checkpoint``, ``finish``) does the work on each rank and returns plain, picklable records;
after ``setup()``, :func:`drive` calls the other stages in the order the :class:`LoopPlan` gives and owns the
:class:`~train_recipes.metrics.RunLogger` (metrics.jsonl, trackers, progress bar, lines above
it) and the summary. Under SPMD every rank calls :func:`drive` on its own recipe object (rank
0 logs); a controller process that holds no model can call it on an object that forwards each
stage to per-rank workers and returns rank 0's record (the records are identical on every rank:
their numbers are agreed by collectives inside the stages).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from train_recipes.end_state import EndRecorder
from train_recipes.metrics import RunLogger, loss_plot_or_notice
from train_recipes.run_folder import write_atomic

__all__ = [
    "LoopOutcome",
    "LoopPlan",
    "LoopStop",
    "RecipeStages",
    "RunEnd",
    "RunStart",
    "StepRecord",
    "drive",
    "progress_postfix",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class LoopPlan:
    """When a run logs, evaluates and saves: the one place that decides what step k does.

    Attributes:
        total_steps: optimizer steps of the whole run.
        log_every: steps between metric records (the last step always logs).
        eval_every: steps between held-out evaluations (the last step too); 0 never.
        checkpoint_every: steps between checkpoints; 0 only ``checkpoint_last``.
        checkpoint_last: save the last step whatever ``checkpoint_every`` says (the trained
            weights then never depend on an export).
    """

    total_steps: int
    log_every: int
    eval_every: int = 0
    checkpoint_every: int = 0
    checkpoint_last: bool = False

    def logs(self, step: int) -> bool:
        """Whether step ``step`` writes a metric record."""
        return step % self.log_every == 0 or step == self.total_steps

    def evaluates(self, step: int) -> bool:
        """Whether the held-out evaluation runs after step ``step``."""
        return self.eval_every > 0 and (step % self.eval_every == 0 or step == self.total_steps)

    def checkpoints(self, step: int) -> bool:
        """Whether a checkpoint is written after step ``step``."""
        if step == self.total_steps and self.checkpoint_last:
            return True
        return self.checkpoint_every > 0 and step % self.checkpoint_every == 0


@dataclass(kw_only=True, slots=True, frozen=True)
class RunStart:
    """What ``setup()`` reports: where the run writes and how far it already is.

    Attributes:
        output_dir: the run directory.
        plan: the loop's plan.
        start_step: the last step already done (0 for a fresh run, the checkpoint's on resume).
        finished: nothing is left to train (a finished run resumed); the loop returns at once.
        desc: the progress bar's label.
        tensorboard: write TensorBoard event files.
        loggers: further experiment trackers ("wandb", "mlflow").
        run_config: the config as plain data, for the trackers.
        lines: printed once the progress output exists (e.g. "resumed from ...").
    """

    output_dir: Path
    plan: LoopPlan
    start_step: int = 0
    finished: bool = False
    desc: str = ""
    tensorboard: bool = True
    loggers: tuple[str, ...] = ()
    run_config: dict[str, Any] | None = None
    lines: tuple[str, ...] = ()


@dataclass(kw_only=True, slots=True, frozen=True)
class StepRecord:
    """What a stage reports for one step: plain numbers, the same on every rank.

    Attributes:
        step: the step the record belongs to (0: before training).
        metrics: the metric record for metrics.jsonl and the trackers (``loss``,
            ``loss_avg_window``, ``lr``, ``grad_norm``, token counts, skips, MoE metrics,
            ``eval/...``); empty when the step logs nothing.
        lines: messages for the console, printed above the progress bar (rank 0).
    """

    step: int
    metrics: dict[str, Any] = field(default_factory=dict)
    lines: tuple[str, ...] = ()


@dataclass(kw_only=True, slots=True, frozen=True)
class RunEnd:
    """What ``finish()`` reports: the last records and the run's summary.

    Attributes:
        record: metrics logged at the last step (final evaluation) and console lines.
        summary: written to ``summary.json`` (plain data).
        export_dir: the Hugging Face export as published on this rank (None elsewhere).
    """

    record: StepRecord
    summary: dict[str, Any]
    export_dir: Path | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class LoopStop:
    """A run its processes agreed to stop at a step boundary (:mod:`train_recipes.preemption`).

    Attributes:
        step: the last step trained.
        signum: the signal's number.
        saved: a checkpoint of ``step`` was written (False: stopped before this job's first
            step, whose newest checkpoint is the one it resumed from, if any).
    """

    step: int
    signum: int
    saved: bool


@dataclass(kw_only=True, slots=True, frozen=True)
class LoopOutcome:
    """What :func:`drive` returns: the setup report and, when the run trained, its end.

    ``end`` is None when a finished run was resumed or when the run stopped (``stopped``).
    """

    start: RunStart
    end: RunEnd | None
    stopped: LoopStop | None = None


class RecipeStages(Protocol):
    """The stages a recipe object offers to :func:`drive` (every rank, or a controller's proxy)."""

    def setup(self) -> RunStart:
        """Build everything (process groups, data, model, Engine); restore on resume."""
        ...

    def train_step(self, step: int) -> StepRecord:
        """One optimizer step (all its micro-batches); metrics on the plan's log steps."""
        ...

    def evaluate(self, step: int) -> StepRecord:
        """The evaluations due at ``step`` (0: before training, on a fresh run only)."""
        ...

    def checkpoint(self, step: int) -> None:
        """Save a checkpoint of ``step`` (collective)."""
        ...

    def finish(self) -> RunEnd:
        """Final evaluation and export; the summary."""
        ...


def progress_postfix(metrics: dict[str, Any]) -> dict[str, str]:
    """The progress bar's short fields of a metric record (loss, window average, tok/s, lr).

    Tokens/s per GPU replaces the global tok/s where the record has it (SFT), and MFU and peak
    memory follow where measured.
    """
    postfix = {"loss": f"{metrics['loss']:.4f}", "avg": f"{metrics['loss_avg_window']:.4f}"}
    if "tokens_per_s_per_gpu" in metrics:
        postfix["tok/s/gpu"] = f"{metrics['tokens_per_s_per_gpu']:.0f}"
    elif "tokens_per_s" in metrics:
        postfix["tok/s"] = f"{metrics['tokens_per_s']:.0f}"
    if "mfu" in metrics:
        postfix["mfu"] = f"{100 * metrics['mfu']:.1f}%"
    if "peak_memory_gib" in metrics:
        postfix["mem"] = f"{metrics['peak_memory_gib']:.1f}GiB"
    postfix["lr"] = f"{metrics['lr']:.2e}"
    return postfix


def _emit(run_log: RunLogger, record: StepRecord, *, progress: bool = False) -> None:
    for line in record.lines:
        run_log.write(line)
    if record.metrics:
        run_log.log(record.step, record.metrics)
        if progress and "loss" in record.metrics:
            run_log.progress(record.step, progress_postfix(record.metrics))


def _stop(vote: Callable[[int], int | None] | None, step: int, *, saved: bool) -> LoopStop | None:
    signum = None if vote is None else vote(step)
    return None if signum is None else LoopStop(step=step, signum=signum, saved=saved)


def _run_steps(
    stages: RecipeStages,
    start: RunStart,
    run_log: RunLogger,
    stop_vote: Callable[[int], int | None] | None,
) -> LoopStop | None:
    """The steps after ``start.start_step`` to the plan's end; the stop the processes agreed on."""
    plan = start.plan
    if (stopped := _stop(stop_vote, start.start_step, saved=False)) is not None:
        return stopped
    if start.start_step == 0:
        _emit(run_log, stages.evaluate(0))
    run_log.start_steps()
    for step in range(start.start_step + 1, plan.total_steps + 1):
        _emit(run_log, stages.train_step(step), progress=True)
        if step < plan.total_steps and (stopped := _stop(stop_vote, step, saved=True)):
            stages.checkpoint(step)  # within the grace period: no evaluation first
            return stopped
        if plan.evaluates(step):
            _emit(run_log, stages.evaluate(step))
        if plan.checkpoints(step):
            stages.checkpoint(step)
    return None


def drive(
    stages: RecipeStages,
    start: RunStart,
    *,
    is_main: bool,
    format_summary: Callable[[RunEnd, Path, Path | None], str],
    stop_vote: Callable[[int], int | None] | None = None,
) -> LoopOutcome:
    """Run a recipe's stages from ``start`` to the end of its plan, logging on the main process.

    Args:
        stages: the recipe object (or a controller's proxy of the per-rank objects).
        start: what ``stages.setup()`` returned (called first: it tells which rank is main).
        is_main: this process logs, plots and writes ``summary.json`` and ``state.json`` (how
            far the run's end got: :mod:`train_recipes.end_state`) (SPMD rank 0, or the
            controller).
        format_summary: the recipe's summary table from its :class:`RunEnd`, the run
            directory and the loss plot's path (None without one).
        stop_vote: called with the step just done at every boundary before the last step
            (and with ``start.start_step`` before the first), by every process at the same
            boundaries; a signal number, the same on every process, stops the run there: a
            checkpoint of the step (none before the first step), no evaluation, no finish.

    Returns:
        The setup report and the end of the run (None when a finished run was resumed or
        the run stopped).
    """
    if start.finished:
        return LoopOutcome(start=start, end=None)
    run_log = RunLogger(start, enabled=is_main)
    # state.json: how far the end got, so a resume finishes an interrupted one.
    ends = EndRecorder(
        start.output_dir,
        steps=start.plan.total_steps,
        start_step=start.start_step,
        enabled=is_main,
    )
    try:
        for line in start.lines:
            run_log.write(line)
        stopped = _run_steps(stages, start, run_log, stop_vote)
        run_log.close_bar()
        if stopped is None:
            ends.record(trained=True, final_checkpoint=start.plan.checkpoint_last)
        end = stages.finish() if stopped is None else None
        if end is not None:
            ends.record(exported=end.export_dir is not None)
            _emit(run_log, end.record)
    finally:
        run_log.close_bar()  # an aborted run's error line must not land in the bar
    run_log.close()
    if end is None:
        return LoopOutcome(start=start, end=None, stopped=stopped)
    if is_main:
        png = loss_plot_or_notice(start.output_dir)
        write_atomic(start.output_dir / "summary.json", json.dumps(end.summary, indent=2))
        ends.record(summary=True)
        print(format_summary(end, start.output_dir, png), flush=True)
    return LoopOutcome(start=start, end=end)
