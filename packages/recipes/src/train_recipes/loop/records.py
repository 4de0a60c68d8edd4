"""The records the training loop passes around: the plan, and what each stage reports.

Plain, picklable dataclasses, the same on every rank: a recipe's stages return them,
:func:`train_recipes.loop.drive.drive` reads them, and :mod:`train_recipes.loop.metrics` logs
them (which is why they live apart from both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from train_recipes.run.preemption import LoopStop

__all__ = [
    "LoopOutcome",
    "LoopPlan",
    "RecipeStages",
    "RunEnd",
    "RunStart",
    "StepRecord",
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
