"""Which checkpoint a resume takes, and what the run that wrote it says.

A resume takes the newest complete checkpoint (train-engine's marker-checked list) and falls
back to the previous one when a file fails its checksum; when complete checkpoints exist but
none loads it refuses (:class:`ResumeRefused`), changing nothing. Before any rank starts,
:func:`plan_resume` reads the newest readable one's config (rank 0's extra state, no tensors)
so that a config change the resume would refuse fails at once. Which config changes a resume
applies is :mod:`train_recipes.run.resume_changes`; restoring the state of the checkpoint taken
is :mod:`train_recipes.run.checkpoints`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from train_recipes.config.sft import SFTConfig
from train_recipes.run.checkpoint_folder import complete_checkpoints
from train_recipes.run.health import TrainingAborted
from train_recipes.run.resume_changes import config_changes

if TYPE_CHECKING:
    from train_engine import Engine

__all__ = [
    "ResumeRefused",
    "SavedRun",
    "load_newest",
    "load_or_refuse",
    "plan_resume",
    "read_saved_run",
    "saved_extras",
]


class ResumeRefused(TrainingAborted):
    """``--resume`` found complete checkpoints but none loads; nothing was changed."""


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


def _load_first_good(
    engine: Engine, candidates: list[Path], *, say: Callable[[str], None]
) -> tuple[tuple[Path, Any] | None, dict[Path, str]]:
    """The first of ``candidates`` that loads, and the first problem of each that did not."""
    from train_engine import CheckpointCorruptError

    failed: dict[Path, str] = {}
    for ckpt in candidates:
        try:
            return (ckpt, engine.load_checkpoint(ckpt)), failed
        except CheckpointCorruptError as err:  # raised on every rank, nothing loaded yet
            failed[ckpt] = err.problems[0] if err.problems else str(err)
        except FileNotFoundError as err:  # the marker vanished (agreed over the ranks too)
            failed[ckpt] = str(err)
        if ckpt != candidates[-1]:
            say(f"checkpoint {ckpt} did not load: {failed[ckpt]}; falling back to the previous one")
    return None, failed


def load_newest(
    engine: Engine, candidates: list[Path], *, say: Callable[[str], None]
) -> tuple[Path, Any] | None:
    """Load the first of ``candidates`` whose files pass their checksums (collective).

    A corrupt checkpoint (train-engine's CheckpointCorruptError, raised on every rank before
    any state changed) is reported, naming its bad file, and the previous one is tried.

    Returns:
        (the checkpoint loaded, this rank's extra state), or None when none loads.
    """
    return _load_first_good(engine, candidates, say=say)[0]


def load_or_refuse(
    engine: Engine, candidates: list[Path], *, root: Path, say: Callable[[str], None]
) -> tuple[Path, Any]:
    """Load the first of ``candidates`` that loads, or refuse the resume (collective).

    Args:
        engine: the Engine to load into.
        candidates: complete checkpoints, newest first (at least one).
        root: the checkpoints' folder, named in the refusal.
        say: prints one line on rank 0 (each checkpoint that did not load).

    Returns:
        (the checkpoint loaded, this rank's extra state; None after a change of world size).

    Raises:
        ResumeRefused: none loads (on every rank; nothing changed, no file moved).
    """
    loaded, failed = _load_first_good(engine, candidates, say=say)
    if loaded is None:  # on every rank: the load's outcome is agreed
        raise _refusal(root, failed)
    return loaded


def _refusal(root: Path, failed: dict[Path, str]) -> ResumeRefused:
    problems = "; ".join(f"{path.name}: {problem}" for path, problem in failed.items())
    return ResumeRefused(
        f"no checkpoint in {root} loads ({problems}); nothing was changed. Restore the files "
        "and resume again, or start a new run (--overwrite, or another --output-dir)"
    )


def _on_disk(checkpoint: Path) -> Path:
    # The engine returns <dir> for a <dir>.old left by a crash between its two renames.
    return checkpoint if checkpoint.is_dir() else checkpoint.with_name(checkpoint.name + ".old")


def _rank_file(checkpoint: Path, rank: int) -> Path:
    # train-engine's documented layout: <dir>/rank_NNNNN.pt = {"rng": ..., "extra": ...}.
    return _on_disk(checkpoint) / f"rank_{rank:05d}.pt"


def saved_extras(checkpoint: Path) -> list[Any]:
    """The extra state of every rank that saved ``checkpoint``, in rank order (no tensors)."""
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
