"""Checkpoints of the SFT recipe and how a run resumes from them.

What a save holds besides the Engine's state, which checkpoint a resume takes, and which config
changes a resume applies or refuses.

A save's per-rank extra state holds the loader position, the step, the loss window, the first
logged loss, the held-out accuracy before training and the config that trained up to it. A
resume takes the newest complete checkpoint (train-engine's marker-checked list), falls back to
the previous one when a file fails its checksum, and starts clean, saying so, when none is
complete. Which config changes a resume applies is :mod:`train_recipes.resume_changes`.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from train_recipes.config_loader import to_dict
from train_recipes.config_sft import SFTConfig
from train_recipes.resume_changes import config_changes
from train_recipes.run_folder import CHECKPOINT_DIR

if TYPE_CHECKING:
    from energon_sft import SFTLoader
    from train_engine import Engine, LossWindow
    from train_recipes.colocated import ColocatedLoader

__all__ = [
    "Restored",
    "SavedRun",
    "checkpoint_dir",
    "complete_checkpoints",
    "load_newest",
    "plan_resume",
    "read_saved_run",
]

logger = logging.getLogger(__name__)

# Changing these measures the held-out accuracy on another set or budget.
_EVAL_KEYS = frozenset({"train.eval_samples", "train.eval_max_new_tokens", "data.eval_path"})


@dataclass(kw_only=True, slots=True, frozen=True)
class SavedRun:
    """What a checkpoint says about the run that wrote it (read from rank 0's extra state).

    Attributes:
        path: the checkpoint directory read.
        step: optimizer steps done.
        config: the config that trained up to ``step`` (None for checkpoints of older versions).
        logical_shards: the loader's logical shard count (None when unknown).
    """

    path: Path
    step: int
    config: dict[str, Any] | None
    logical_shards: int | None


@dataclass(kw_only=True, slots=True)
class Restored:
    """What a resume restored besides the Engine (identical on every rank).

    Attributes:
        path: the checkpoint loaded.
        step: its step.
        accuracy_before: held-out accuracy before training (None when not comparable).
        first_loss: the run's first logged loss.
        changes: the config changes applied, ``key -> (old, new)``.
    """

    path: Path
    step: int
    accuracy_before: float | None
    first_loss: float | None
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """``<output_dir>/checkpoints/step_NNNNNN``."""
    return Path(output_dir) / CHECKPOINT_DIR / f"step_{step:06d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The run's complete checkpoints, newest first (train-engine's marker check)."""
    from train_engine import complete_checkpoints as engine_complete_checkpoints

    return engine_complete_checkpoints(Path(output_dir) / CHECKPOINT_DIR)


def load_newest(
    engine: Engine, candidates: list[Path], *, say: Callable[[str], None]
) -> tuple[Path, Any] | None:
    """Load the first of ``candidates`` whose files pass their checksums (collective).

    A corrupt checkpoint (train-engine's CheckpointCorruptError, raised on every rank before
    any state changed) is reported, naming its bad files, and the previous one is tried.

    Returns:
        (the checkpoint loaded, this rank's extra state), or None when none loads.
    """
    from train_engine import CheckpointCorruptError

    for ckpt in candidates:
        try:
            return ckpt, engine.load_checkpoint(ckpt)
        except CheckpointCorruptError as err:
            say(f"{err}; falling back to the previous checkpoint")
    return None


def _on_disk(checkpoint: Path) -> Path:
    # The engine returns <dir> for a <dir>.old left by a crash between its two renames.
    return checkpoint if checkpoint.is_dir() else checkpoint.with_name(checkpoint.name + ".old")


def _rank_file(checkpoint: Path, rank: int) -> Path:
    # train-engine's documented layout: <dir>/rank_NNNNN.pt = {"rng": ..., "extra": ...}.
    return _on_disk(checkpoint) / f"rank_{rank:05d}.pt"


def _all_extras(checkpoint: Path) -> list[Any]:
    files = sorted(_on_disk(checkpoint).glob("rank_*.pt"))
    return [torch.load(f, weights_only=False)["extra"] for f in files]


def read_saved_run(checkpoint: str | Path) -> SavedRun:
    """Read rank 0's extra state of a checkpoint (cheap: no model or optimizer tensors).

    Raises:
        OSError, RuntimeError, KeyError: unreadable or not a checkpoint of this recipe.
    """
    path = Path(checkpoint)
    extra = torch.load(_rank_file(path, 0), weights_only=False)["extra"]
    config = extra.get("config")
    shards = extra.get("logical_shards")
    return SavedRun(
        path=path,
        step=int(extra["step"]),
        config=config,
        logical_shards=None if shards is None else int(shards),
    )


def plan_resume(config: SFTConfig, *, world_size: int) -> SavedRun | None:
    """Pre-launch check of ``--resume``: the newest readable complete checkpoint, if any.

    Raises:
        ConfigError: a config change the resume would refuse (before any rank starts).
    """
    for candidate in complete_checkpoints(config.train.output_dir):
        try:
            saved = read_saved_run(candidate)
        except Exception:  # the ranks report it and fall back; the parent only pre-checks
            continue
        if saved.config is not None:
            dp = world_size // (config.parallel.cp * config.parallel.tp)
            config_changes(
                saved.config,
                config,
                saved_shards=saved.logical_shards,
                new_shards=config.data.num_logical_shards or dp,
            )
        return saved
    return None


def _optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _apply_optimizer_settings(
    optimizer: torch.optim.Optimizer, scheduler: Any, settings: list[dict[str, Any]]
) -> None:
    """Put the config's hyperparameters back after a load (torch's load takes the saved ones).

    The scheduler's base rates become the config's ``initial_lr`` and each group's rate is
    recomputed at the saved step, exactly as LambdaLR computes it, so an unchanged config
    gives the saved rates bit for bit and a new ``optim.lr`` or schedule applies from the
    next step.
    """
    for group, wanted in zip(optimizer.param_groups, settings, strict=True):
        group.update(wanted)
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
    data_plane: Any = None,
) -> Path:
    """Save a checkpoint of ``step`` and prune older ones of this run (collective).

    ``data_plane`` (a ``DataPlane``: the samples each step trained on) is saved with this
    rank's extra state, inside the checkpoint's atomic swap.
    """
    import torch.distributed as dist

    target = checkpoint_dir(output_dir, step)
    engine.save_checkpoint(
        target,
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
        },
    )
    if is_main:
        _prune(output_dir, keep=config.train.keep_checkpoints, upto=step)
    dist.barrier()
    return target


def _step_of(name: str) -> int | None:
    base = name.removesuffix(".tmp").removesuffix(".old")
    if not base.startswith("step_") or not base[5:].isdigit():
        return None
    return int(base[5:])


def _prune(output_dir: Path, *, keep: int, upto: int) -> None:
    """Keep the newest ``keep`` checkpoints of steps <= ``upto``.

    Never a higher step: those are not this timeline's and were removed at resume.
    """
    if keep <= 0:
        return
    root = output_dir / CHECKPOINT_DIR
    entries = [(s, p) for p in root.iterdir() if (s := _step_of(p.name)) is not None and s <= upto]
    kept = sorted({s for s, _ in entries}, reverse=True)[:keep]
    for step, path in entries:
        if step not in kept:
            shutil.rmtree(path, ignore_errors=True)


def _drop_newer(output_dir: Path, step: int) -> list[str]:
    """Remove checkpoints newer than the one resumed from.

    They failed to load or are a discarded timeline; a reader would otherwise take them first.
    """
    root = output_dir / CHECKPOINT_DIR
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        found = _step_of(path.name)
        if found is not None and found > step:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


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
    data_plane: Any = None,
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
        is_main: rank 0 (removes stale checkpoints).
        say: prints one line on rank 0.

    Returns:
        What was restored, or None when no checkpoint is complete (a clean start).

    Raises:
        ConfigError: a refused config change.
    """
    import torch.distributed as dist

    out_dir = Path(config.train.output_dir)
    candidates = complete_checkpoints(out_dir)
    if not candidates:
        say(f"no complete checkpoint in {out_dir / CHECKPOINT_DIR}: starting clean from step 0")
        return None
    wanted = _optimizer_settings(engine.optimizer)  # the config's, before a load replaces them
    loaded = load_newest(engine, candidates, say=say)
    if loaded is None:
        if is_main:
            _drop_newer(out_dir, 0)
        dist.barrier()
        say(f"no checkpoint in {out_dir / CHECKPOINT_DIR} loads: starting clean from step 0")
        return None
    ckpt, extra = loaded
    # Another world size: the engine restores no per-rank state; the loader continues from the
    # envelopes of all old ranks (any dp dividing the logical shards). Read after the load,
    # whose checksums covered these files.
    extras = [extra] if extra is not None else _all_extras(ckpt)
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
    _apply_optimizer_settings(engine.optimizer, engine.lr_scheduler, wanted)
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
        removed = _drop_newer(out_dir, step)
        if removed:
            say(
                f"removed checkpoints newer than step {step} (they did not load): {', '.join(removed)}"
            )
    dist.barrier()
    accuracy = extra.get("accuracy_before")
    if accuracy is not None and _EVAL_KEYS & set(changes):
        say("held-out settings changed: the accuracy before training is not comparable, dropped")
        accuracy = None
    for key, (before, after) in changes.items():
        say(f"resume applies {key}: {before!r} -> {after!r}")
    saved_dp = extra.get("dp_size")
    if saved_dp is not None and saved_dp != dp_size:
        say(_layout_note(saved_dp, engine_accum_before, dp_size, config))
    return Restored(
        path=ckpt,
        step=step,
        accuracy_before=accuracy,
        first_loss=extra.get("first_loss"),
        changes=changes,
    )
