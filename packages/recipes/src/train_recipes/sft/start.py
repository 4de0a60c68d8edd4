"""Where an SFT run starts: its loop plan, and what it reports once set up (fresh or resumed)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from train_recipes.config.loader import to_dict
from train_recipes.loop.records import LoopPlan, RunStart
from train_recipes.run.end_state import missing_end
from train_recipes.run.folder import rank0_printer, record_config_changes
from train_recipes.run.runtime import write_run_config

if TYPE_CHECKING:
    from train_recipes.config.sft import SFTConfig
    from train_recipes.run.checkpoints import Restored
    from train_recipes.run.process_group import RankContext

__all__ = ["loop_plan", "run_start"]


def loop_plan(config: SFTConfig) -> LoopPlan:
    """The steps at which the run logs, evaluates and checkpoints (always after the last)."""
    train = config.train
    return LoopPlan(
        total_steps=train.steps,
        log_every=train.log_every,
        eval_every=train.eval_every,
        checkpoint_every=train.checkpoint_every,
        checkpoint_last=True,
    )


def run_start(
    config: SFTConfig,
    ctx: RankContext,
    out_dir: Path,
    *,
    plan: LoopPlan,
    start_step: int,
    restored: Restored | None,
    optimizer_line: str,
) -> RunStart:
    """What ``setup()`` reports; writes config.yaml and the config history unless finished.

    A run resumed at its last step whose end (final checkpoint, export, summary) is complete
    reports ``finished``; one whose end was interrupted goes on to finish it.

    Args:
        config: the run's config (its length resolved).
        ctx: this rank's place in the job.
        out_dir: the run folder.
        plan: :func:`loop_plan` of the config.
        start_step: the last step already trained (0 for a fresh run).
        restored: what a resume restored (None for a fresh run).
        optimizer_line: the start-up line naming the optimizer built.
    """
    train = config.train
    say = rank0_printer(ctx.is_main)
    missing = []
    if start_step == train.steps:  # trained; the end may have been interrupted
        missing = missing_end(out_dir, steps=train.steps, export=train.export)
    if start_step >= train.steps and not missing:
        say(f"{out_dir} finished at step {start_step} (train.steps={train.steps}); nothing to do")
        return RunStart(output_dir=out_dir, plan=plan, start_step=start_step, finished=True)
    if missing:
        say(
            f"{out_dir} trained all {train.steps} steps but its end was interrupted: "
            f"finishing {' and '.join(missing)}"
        )
    # config.yaml says what trains from here on; the history, what changed when.
    write_run_config(out_dir, config, is_main=ctx.is_main)
    if ctx.is_main:
        changes = {} if restored is None else restored.changes
        record_config_changes(out_dir, step=start_step, changes=changes)
    lines: tuple[str, ...] = (optimizer_line,)
    if restored is not None:
        lines += (f"resumed from {restored.path} at step {start_step}",)
    return RunStart(
        output_dir=out_dir,
        plan=plan,
        start_step=start_step,
        desc=f"sft dp={ctx.dp_size} cp={ctx.cp_size} tp={ctx.tp_size}",
        tensorboard=train.tensorboard,
        loggers=train.loggers,
        run_config=to_dict(config),
        lines=lines,
    )
