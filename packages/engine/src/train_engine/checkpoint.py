"""Atomic, resumable checkpoints of model, optimizer, scheduler, counters, RNG and caller state.

Model and optimizer go through torch.distributed.checkpoint (DCP, sharded for FSDP2/DTensor);
the scheduler, the Engine's counters, RNG states and caller state are plain files.

Layout of a checkpoint directory::

    <dir>/model_optim/      DCP files (every rank writes its shards)
    <dir>/meta.pt           rank 0: scheduler and Engine state
    <dir>/rank_00000.pt     per rank: RNG states and the caller's extra state
    <dir>/COMPLETE          JSON marker, written last: Engine counters and the size and CRC-32
                            of every other file (format 2; see :mod:`train_engine._checksums`)

A save writes everything into ``<dir>.tmp`` and only then renames it to ``<dir>`` (a directory
that already exists is first moved aside to ``<dir>.old``), so an interrupted save never damages
the previous checkpoint; :func:`load_checkpoint` falls back to ``<dir>.old`` when a crash hit
between the two renames. All ranks must see the same filesystem. A save that fails (a full
disk, any OS error, on any rank) removes ``<dir>.tmp`` and raises
:class:`CheckpointWriteError` on every rank together, naming the OS error and the bytes
written and free. ``optimizer_state=False`` saves everything but the optimizer's state; its
load starts the optimizer afresh from the loaded weights.

A load first verifies the recorded checksums (the files split over the ranks), reads the small
files, and agrees on the outcome across all ranks; only then does it touch the model,
optimizer, scheduler or RNG. So a corrupt checkpoint raises :class:`CheckpointCorruptError`
on every rank with the state unchanged, and the caller can try the previous one
(:func:`complete_checkpoints`). Checkpoints of format 1 (no checksums) still load.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train_engine._checkpoint_common import (
    DCP_DIR,
    MARKER,
    META,
    READABLE_FORMATS,
    CheckpointCorruptError,
    Failure,
    all_gather,
    distributed,
    is_complete,
    paths,
    raise_agreed,
    rank_world,
)
from train_engine._checkpoint_save import CheckpointWriteError, save_checkpoint
from train_engine._checksums import assign_to_ranks, mismatches
from train_engine._rng import set_rng_state
from train_engine.expert_parallel import checkpoint_views
from train_engine.master_adamw import MasterWeightAdamW

__all__ = [
    "CheckpointCorruptError",
    "CheckpointWriteError",
    "LoadedCheckpoint",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored besides model, optimizer and scheduler.

    Attributes:
        engine_state: the Engine counters saved with the checkpoint.
        extra_state: this rank's caller state (None when the world size changed).
        path: the directory actually read (``<dir>.old`` after an interrupted swap).
        optimizer_state: the checkpoint held the optimizer's state and it was restored; False
            for a checkpoint saved with ``optimizer_state=False`` (the optimizer was restarted
            from the loaded weights).
    """

    engine_state: dict[str, int]
    extra_state: Any
    path: Path
    optimizer_state: bool = True


def _resolve(directory: str | os.PathLike[str]) -> Path:
    """The directory to read: ``directory``, or ``<dir>.old`` after an interrupted swap."""
    target, tmp, old = paths(directory)
    if is_complete(target):
        return target
    if not target.exists() and is_complete(old):
        logger.warning("%s is missing after an interrupted save; loading %s", target, old)
        return old
    hint = f" ({tmp} is an interrupted save)" if tmp.exists() else ""
    raise FileNotFoundError(
        f"no complete checkpoint at {target}{hint}: the {MARKER} marker is missing; "
        "pass the directory of a finished save_checkpoint() (see latest_checkpoint())"
    )


def _read_marker(path: Path) -> dict[str, Any]:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _Corrupt([f"{path / MARKER}: unreadable ({type(err).__name__}: {err})"]) from err
    if not isinstance(marker, dict):
        raise _Corrupt([f"{path / MARKER}: not a JSON object"])
    return marker


class _Corrupt(Exception):
    """Local to one rank until agreed; becomes :class:`CheckpointCorruptError` on all ranks."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=False)
    except Exception as err:  # truncated or garbled pickles raise many types
        raise _Corrupt([f"{path}: unreadable ({type(err).__name__}: {err})"]) from err


def _read_small_files(
    directory: str | os.PathLike[str], rank: int, world: int, verify: bool
) -> tuple[Path, dict[str, Any], dict[str, Any] | None]:
    """Everything a load needs before it touches state, read (and verified) on this rank.

    Returns:
        (checkpoint directory, meta, this rank's RNG/extra file or None when the world size
        changed).
    """
    path = _resolve(directory)
    marker = _read_marker(path)
    files = marker.get("files")
    if verify and isinstance(files, dict):
        share = assign_to_ranks(files, world)[rank]
        problems = mismatches(path, files, share)
        if problems:
            raise _Corrupt(problems)
    elif verify:
        logger.info("checkpoint %s has no checksums (format 1): loading it unverified", path)
    meta = _torch_load(path / META)
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(
            f"checkpoint format {found} at {path} is not one of the supported "
            f"{READABLE_FORMATS}; it was written by another version of train-engine"
        )
    per_rank = None
    if meta["world_size"] == world:
        per_rank = _torch_load(path / f"rank_{rank:05d}.pt")
    return path, meta, per_rank


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any = None,
    verify: bool = True,
) -> LoadedCheckpoint:
    """Load a checkpoint written by :func:`save_checkpoint` (collective).

    First, with nothing changed yet: the recorded checksums are verified (each rank reads a
    balanced share of the files, so the whole checkpoint is read once more), the small files
    are read, and the ranks agree on the outcome. Then model and optimizer are loaded,
    resharded by DCP if the parallel layout changed; RNG states and extra state are per rank
    and restored only when the world size is unchanged. A checkpoint saved with
    ``optimizer_state=False`` loads the model only and restarts the optimizer: zero moments
    and steps (:class:`~train_engine.MasterWeightAdamW` takes its master weights from the
    loaded parameters); ``LoadedCheckpoint.optimizer_state`` is then False.

    Args:
        directory: a checkpoint directory (see :func:`complete_checkpoints`).
        model: the model to load into (same structure as at save).
        optimizer: its optimizer.
        lr_scheduler: loaded when given.
        verify: check the recorded checksums first (format 2). Off, a corrupt file may load
            silently.

    Raises:
        FileNotFoundError: no complete checkpoint at ``directory`` (nor at ``<dir>.old``).
        CheckpointCorruptError: a file is missing, truncated, unreadable or differs from what
            the save recorded; raised on every rank together, with the state unchanged.
        ValueError: an unsupported checkpoint format, or no scheduler state to load.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    rank, world = rank_world()
    failure: Failure = None
    try:
        path, meta, per_rank = _read_small_files(directory, rank, world, verify)
    except _Corrupt as err:
        failure = ("corrupt", str(_resolve_quietly(directory)), err.problems)
    except FileNotFoundError as err:
        failure = ("missing", str(directory), [str(err)])
    except ValueError as err:  # an unsupported format
        failure = ("invalid", str(directory), [str(err)])
    except Exception as err:  # anything else must still reach the agreement, or ranks hang
        failure = ("error", str(directory), [f"{type(err).__name__}: {err}"])
    raise_agreed(all_gather(failure))
    if meta["lr_scheduler"] is None and lr_scheduler is not None:
        raise ValueError(f"the checkpoint at {path} holds no scheduler state to load")
    with_optimizer = bool(meta.get("optimizer_state", True))
    if with_optimizer:
        model_state, optim_state = get_state_dict(model, optimizer)
    else:
        model_state, optim_state = get_model_state_dict(model), {}
    # DCP loads in place into the tensors of these dicts (expert shards through DTensor views
    # of the same storage, resharded from whatever ep layout saved them).
    model_view, optim_view = checkpoint_views(model, model_state, optim_state)
    to_load = (
        {"model": model_view, "optim": optim_view} if with_optimizer else {"model": model_view}
    )
    try:
        dcp.load(to_load, checkpoint_id=str(path / DCP_DIR), no_dist=not distributed())
    except Exception as err:
        # Only reachable unverified (format 1, or verify=False); DCP agrees on its failures.
        raise CheckpointCorruptError(
            path, [f"{path / DCP_DIR}: could not be read ({type(err).__name__}: {err})"]
        ) from err
    if with_optimizer:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    else:
        set_model_state_dict(model, model_state)
        _restart_optimizer(optimizer)
        logger.info("checkpoint %s holds no optimizer state: the optimizer starts afresh", path)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(meta["lr_scheduler"])
    extra = None
    if per_rank is not None:
        set_rng_state(per_rank["rng"])
        extra = per_rank["extra"]
    else:
        logger.warning(
            "checkpoint %s was saved by %d ranks, loading on %d: RNG states and extra state "
            "are not restored",
            path,
            meta["world_size"],
            world,
        )
    return LoadedCheckpoint(
        engine_state=meta["engine"], extra_state=extra, path=path, optimizer_state=with_optimizer
    )


def _restart_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Fresh optimizer state for parameters just loaded from a checkpoint without it."""
    if isinstance(optimizer, MasterWeightAdamW):
        optimizer.reset_state()  # its master weights are authoritative: take the loaded ones
    else:
        optimizer.state.clear()  # torch's optimizers create their state at the next step


def _resolve_quietly(directory: str | os.PathLike[str]) -> Path:
    try:
        return _resolve(directory)
    except FileNotFoundError:
        return Path(directory)


def _marker_steps(path: Path) -> int:
    try:
        return int(json.loads((path / MARKER).read_text()).get("optimizer_steps", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        logger.warning("unreadable %s marker in %s: listed last", MARKER, path)
        return -1


def complete_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoint directories under ``root``, newest (most optimizer steps) first.

    Complete means the marker exists; checksums are verified only by :func:`load_checkpoint`.
    Interrupted saves (``*.tmp``) are left out; a ``<dir>.old`` left by a crash during the
    swap is listed as ``<dir>`` (which :func:`load_checkpoint` resolves). Intended use: try
    each in turn, and on :class:`CheckpointCorruptError` report it and try the next::

        for path in complete_checkpoints(root):
            try:
                extra = engine.load_checkpoint(path)
                break
            except CheckpointCorruptError as err:
                logger.warning("%s; falling back to the previous checkpoint", err)
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[str, int] = {}
    for child in root.iterdir():
        if child.name.endswith(".tmp") or not is_complete(child):
            continue
        name = child.name.removesuffix(".old")
        if name in found and child.name != name:
            continue  # <dir> itself is complete: load_checkpoint reads it, not <dir>.old
        found[name] = _marker_steps(child)
    ordered = sorted(found.items(), key=lambda item: (item[1], item[0]), reverse=True)
    return [root / name for name, _ in ordered]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint directory under ``root`` with the most optimizer steps.

    The first of :func:`complete_checkpoints`; None when there is none.
    """
    complete = complete_checkpoints(root)
    return complete[0] if complete else None
