"""The training loop of every recipe, written once: what happens at step k, and who logs it.

A recipe object (:class:`RecipeStages`: ``setup``, ``train_step``, ``evaluate``,
``checkpoint``, ``finish``) does the work on each rank and returns plain, picklable records;
after ``setup()``, :func:`drive` calls the other stages in the order the :class:`LoopPlan` gives and owns the
:class:`~train_recipes.loop.metrics.RunLogger` (metrics.jsonl, trackers, progress bar, lines above
it) and the summary. Under SPMD every rank calls :func:`drive` on its own recipe object (rank
0 logs); a controller process that holds no model can call it on an object that forwards each
stage to per-rank workers and returns rank 0's record (the records are identical on every rank:
their numbers are agreed by collectives inside the stages).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import cast

from train_recipes.loop.metrics import RunLogger, loss_plot_or_notice
from train_recipes.loop.records import (
    LoopOutcome,
    RecipeStages,
    RunEnd,
    RunStart,
    StepRecord,
)
from train_recipes.run.end_state import EndRecorder
from train_recipes.run.folder import write_atomic
from train_recipes.run.preemption import LoopStop

__all__ = ["drive", "progress_postfix"]


def progress_postfix(metrics: Mapping[str, object]) -> dict[str, str]:
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
        postfix["mfu"] = f"{100 * cast(float, metrics['mfu']):.1f}%"
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
            far the run's end got: :mod:`train_recipes.run.end_state`) (SPMD rank 0, or the
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
