"""What a checkpoint of the SFT recipe holds besides the Engine's state: saving and restoring it.

A save's per-rank extra state holds the loader position, the step, the loss window, the first
and last logged losses, the held-out accuracy before training and losses, the skipped steps
and the run of skips, the learning-rate re-base and the config that trained up to it. A
restore loads the checkpoint a resume takes (:mod:`train_recipes.run.resume`), puts the
config's optimizer settings back, continues the loader, the loss window and the records, and
moves the newer checkpoints that did not load to ``checkpoints/damaged/``, never deleting
them; it starts clean, saying so, only when no checkpoint is complete. Which config changes a
resume applies is :mod:`train_recipes.run.resume_changes`; a changed schedule keeps the
learning rate continuous (:class:`train_recipes.run.schedule.Rebase`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from train_recipes.config.loader import to_dict
from train_recipes.config.sft import SFTConfig
from train_recipes.run.checkpoint_folder import (
    DAMAGED_DIR,
    checkpoint_dir,
    complete_checkpoints,
    prune,
    set_aside_newer,
)
from train_recipes.run.folder import CHECKPOINT_DIR
from train_recipes.run.resume import load_or_refuse, saved_extras
from train_recipes.run.resume_changes import (
    SCHEDULE_KEYS,
    config_changes,
    continue_schedule,
    schedule_line,
)
from train_recipes.run.save_failure import save_or_abort
from train_recipes.run.schedule import Rebase

if TYPE_CHECKING:
    from energon_sft import SFTLoader
    from train_engine import Engine, LossWindow
    from train_recipes.data.colocated import ColocatedLoader
    from train_recipes.data.plane import DataPlane

__all__ = ["Restored", "restore", "save"]

logger = logging.getLogger(__name__)

# Changing these measures the held-out accuracy on another set or budget.
_EVAL_KEYS = frozenset({"train.eval_samples", "train.eval_max_new_tokens", "data.eval_path"})


@dataclass(kw_only=True, slots=True)
class Restored:
    """What a resume restored besides the Engine (identical on every rank).

    Attributes:
        path: the checkpoint loaded.
        step: its step.
        accuracy_before: held-out accuracy before training (None when not comparable).
        first_loss: the run's first logged loss.
        last_loss: the loss of the checkpoint's step (None when not logged or not saved).
        eval_losses: the held-out losses measured so far.
        skips: the skip record (:meth:`train_recipes.run.health.SkipTracker.state_dict`), None
            for checkpoints of older versions.
        rebase: the learning-rate correction in force (None: the config's schedule as is).
        changes: the config changes applied, ``key -> (old, new)``.
    """

    path: Path
    step: int
    accuracy_before: float | None
    first_loss: float | None
    last_loss: float | None = None
    eval_losses: list[float] = field(default_factory=list)
    skips: dict[str, Any] | None = None
    rebase: Rebase | None = None
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def _optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _apply_optimizer_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    settings: list[dict[str, Any]],
    rebase: Rebase | None,
) -> None:
    """Put the config's hyperparameters back after a load (torch's load takes the saved ones).

    The scheduler's base rates become the config's ``initial_lr``, its factors take the
    resume's ``rebase`` and each group's rate is recomputed at the saved step, exactly as
    LambdaLR computes it, so an unchanged config gives the saved rates bit for bit and a new
    ``optim.lr`` applies from the next step.
    """
    for group, wanted in zip(optimizer.param_groups, settings, strict=True):
        group.update(wanted)
    if rebase is not None:
        scheduler.lr_lambdas = [rebase.apply(fn) for fn in scheduler.lr_lambdas]
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    rates = [
        base * fn(scheduler.last_epoch)
        for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)
    ]
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = rates


def _mean_window(states: list[dict[str, Any]]) -> dict[str, Any]:
    # Each rank's window holds its share of the global loss; the mean over the old ranks is the
    # global loss itself, which every new rank holds after a change of the world size.
    values = torch.tensor([s["values"] for s in states], dtype=torch.float64).mean(0)
    return {**states[0], "values": values.tolist()}


def save(
    engine: Engine,
    output_dir: Path,
    *,
    step: int,
    loader: SFTLoader | ColocatedLoader,
    window: LossWindow,
    config: SFTConfig,
    dp_size: int,
    accuracy_before: float | None,
    first_loss: float | None,
    is_main: bool,
    data_plane: DataPlane | None = None,
    last_loss: float | None = None,
    eval_losses: list[float] | None = None,
    skips: dict[str, Any] | None = None,
    rebase: Rebase | None = None,
) -> Path:
    """Save a checkpoint of ``step`` and prune older ones of this run (collective).

    A save that fails stops the run with one line and prunes nothing; at the last step the
    weights alone are tried then (:func:`train_recipes.run.save_failure.save_or_abort`).

    ``data_plane`` (a ``DataPlane``: the samples each step trained on) is saved with this
    rank's extra state, inside the checkpoint's atomic swap, as are the records a resume
    continues (``last_loss``, ``eval_losses``, ``skips``: the SkipTracker's state) and the
    learning-rate correction in force (``rebase``).
    """
    import torch.distributed as dist

    target = checkpoint_dir(output_dir, step)
    # A failed save stops the run here, on every rank, before anything is pruned.
    save_or_abort(
        engine,
        target,
        optimizer_state=config.train.checkpoint_optimizer,
        final=step == config.train.steps,
        extra_state={
            "loader": loader.state_dict(),
            "step": step,
            "accuracy_before": accuracy_before,
            "first_loss": first_loss,
            "loss_window": window.state_dict(),
            "config": to_dict(config),
            "logical_shards": config.data.num_logical_shards or dp_size,
            "dp_size": dp_size,
            "data_plane": None if data_plane is None else data_plane.state_dict(),
            "last_loss": last_loss,
            "eval_losses": list(eval_losses or []),
            "skips": skips,
            "lr_rebase": None if rebase is None else dataclasses.asdict(rebase),
        },
    )
    if is_main:
        prune(output_dir, keep=config.train.keep_checkpoints, upto=step)
    dist.barrier()
    return target


def _layout_note(saved_dp: int, saved_accum: int, dp_size: int, config: SFTConfig) -> str:
    accum = config.train.gradient_accumulation_steps
    note = f"resume on dp={dp_size} x accumulation {accum} (saved by dp={saved_dp} x {saved_accum})"
    if dp_size * accum == saved_dp * saved_accum:
        return note + ": the same global batch"
    same = saved_dp * saved_accum / dp_size
    fix = f"; train.gradient_accumulation_steps={int(same)} keeps it" if same == int(same) else ""
    return note + f": the global batch changes{fix}"


def restore(
    engine: Engine,
    loader: SFTLoader | ColocatedLoader,
    window: LossWindow,
    config: SFTConfig,
    *,
    dp_size: int,
    is_main: bool,
    say: Callable[[str], None],
    data_plane: DataPlane | None = None,
) -> Restored | None:
    """Load the newest complete checkpoint of ``config.train.output_dir`` (collective).

    Args:
        engine: the Engine (model, optimizer, scheduler).
        loader: the fresh energon-sft loader (before its first batch).
        window: the LossWindow.
        config: the resuming job's config.
        data_plane: the job's ``DataPlane``, given the saved records (all old ranks' after a
            change of the world size); None leaves them.
        dp_size: the resuming job's data-parallel size.
        is_main: rank 0 (sets aside the checkpoints that did not load).
        say: prints one line on rank 0.

    Returns:
        What was restored, or None when no checkpoint is complete (a clean start).

    Raises:
        ConfigError: a refused config change.
        ResumeRefused: complete checkpoints exist but none loads (on every rank; nothing
            changed, no file moved).
    """
    import torch.distributed as dist

    out_dir = Path(config.train.output_dir)
    candidates = complete_checkpoints(out_dir)
    if not candidates:
        say(f"no complete checkpoint in {out_dir / CHECKPOINT_DIR}: starting clean from step 0")
        return None
    wanted = _optimizer_settings(engine.optimizer)  # the config's, before a load replaces them
    ckpt, extra = load_or_refuse(engine, candidates, root=out_dir / CHECKPOINT_DIR, say=say)
    # Another world size: the engine restores no per-rank state; the loader continues from the
    # envelopes of all old ranks (any dp dividing the logical shards). Read after the load,
    # whose checksums covered these files.
    extras = [extra] if extra is not None else saved_extras(ckpt)
    engine_accum_before = engine.gradient_accumulation_steps  # the checkpoint's window
    step = int(extras[0]["step"])
    changes: dict[str, tuple[Any, Any]] = {}
    if extras[0].get("config") is not None:
        shards = extras[0].get("logical_shards")
        changes = config_changes(
            extras[0]["config"],
            config,
            saved_shards=None if shards is None else int(shards),
            new_shards=config.data.num_logical_shards or dp_size,
        )
    engine.set_gradient_accumulation_steps(config.train.gradient_accumulation_steps)
    scheduler = engine.lr_scheduler
    rebase = continue_schedule(extras[0], config, at=scheduler.last_epoch, changes=changes)
    _apply_optimizer_settings(engine.optimizer, scheduler, wanted, rebase)
    if extra is not None:
        loader.load_state_dict(extra["loader"])
        if "loss_window" in extra:
            window.load_state_dict(extra["loss_window"])
        if data_plane is not None and extra.get("data_plane") is not None:
            data_plane.load_state_dict(extra["data_plane"])
    else:
        loader.load_state_dict([e["loader"] for e in extras])
        if all("loss_window" in e for e in extras):
            window.load_state_dict(_mean_window([e["loss_window"] for e in extras]))
        planes = [e["data_plane"] for e in extras if e.get("data_plane") is not None]
        if data_plane is not None and planes:
            data_plane.load_state_dict(planes)
        extra = extras[0]
    if is_main:
        moved = set_aside_newer(out_dir, step)
        if moved:
            say(
                f"moved the checkpoints newer than step {step}, which did not load, to "
                f"{out_dir / CHECKPOINT_DIR / DAMAGED_DIR}: {', '.join(moved)}"
            )
    dist.barrier()
    accuracy = extra.get("accuracy_before")
    if accuracy is not None and _EVAL_KEYS & set(changes):
        say("held-out settings changed: the accuracy before training is not comparable, dropped")
        accuracy = None
    for key, (before, after) in changes.items():
        say(f"resume applies {key}: {before!r} -> {after!r}")
    if rebase is not None and rebase.at == scheduler.last_epoch and rebase.offset:
        keys = [k for k in SCHEDULE_KEYS if k in changes]
        if keys:
            say(schedule_line(scheduler, config, rebase, step=step, keys=keys))
    if not extra.get("optimizer_state", True):
        say(
            f"{ckpt.name} holds the weights without optimizer state (train.checkpoint_optimizer"
            "=false, or kept when a full save failed): AdamW restarts from zero moments"
        )
    saved_dp = extra.get("dp_size")
    if saved_dp is not None and saved_dp != dp_size:
        say(_layout_note(saved_dp, engine_accum_before, dp_size, config))
    return Restored(
        path=ckpt,
        step=step,
        accuracy_before=accuracy,
        first_loss=extra.get("first_loss"),
        last_loss=extra.get("last_loss"),
        eval_losses=list(extra.get("eval_losses") or []),
        skips=extra.get("skips"),
        rebase=rebase,
        changes=changes,
    )
