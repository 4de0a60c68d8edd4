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
between the two renames. All ranks must see the same filesystem.

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
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from train_engine._checksums import (
    ALGORITHM,
    assign_to_ranks,
    checksum_files,
    files_written_by,
    mismatches,
)
from train_engine._rng import rng_state, set_rng_state
from train_engine.expert_parallel import checkpoint_views

__all__ = [
    "CheckpointCorruptError",
    "LoadedCheckpoint",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 2  # 2: per-file checksums in the marker; 1: none
_READABLE_FORMATS = (1, 2)
_MARKER = "COMPLETE"
_DCP_DIR = "model_optim"
_META = "meta.pt"


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's files do not match what was saved, or cannot be read.

    Raised by :func:`load_checkpoint` on every rank together, before any state was changed,
    so the caller may load an earlier checkpoint instead (see :func:`complete_checkpoints`).

    Attributes:
        checkpoint: the checkpoint directory.
        problems: one line per bad file, each naming the file.
    """

    def __init__(self, checkpoint: Path, problems: list[str]) -> None:
        self.checkpoint = checkpoint
        self.problems = tuple(problems)
        shown = "; ".join(problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        super().__init__(
            f"checkpoint {checkpoint} is corrupt: {shown}{more}. Load an earlier complete "
            "checkpoint (train_engine.complete_checkpoints lists them, newest first)"
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored besides model, optimizer and scheduler.

    Attributes:
        engine_state: the Engine counters saved with the checkpoint.
        extra_state: this rank's caller state (None when the world size changed).
        path: the directory actually read (``<dir>.old`` after an interrupted swap).
    """

    engine_state: dict[str, int]
    extra_state: Any
    path: Path


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a collective; just ``[obj]`` without a group)."""
    if not _distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# None, or (kind, checkpoint directory, problem lines): what a rank reports to the others.
_Failure = tuple[str, str, list[str]] | None


def _raise_agreed(failures: list[_Failure]) -> None:
    """Raise the first failing rank's error on every rank (same type, same message).

    Every rank passes the same gathered list, so either all ranks raise or none does.
    """
    failed = [(rank, f) for rank, f in enumerate(failures) if f is not None]
    if not failed:
        return
    rank, (kind, checkpoint, lines) = failed[0]
    if kind == "corrupt":
        # Every rank verified its own share: report all bad files, once each.
        problems = [line for _, f in failed if f[0] == "corrupt" for line in f[2]]
        raise CheckpointCorruptError(Path(checkpoint), list(dict.fromkeys(problems)))
    message = lines[0] + (f" [found by rank {rank}]" if len(failures) > 1 else "")
    errors: dict[str, type[Exception]] = {
        "missing": FileNotFoundError,
        "exists": FileExistsError,
        "invalid": ValueError,
    }
    raise errors.get(kind, RuntimeError)(message)


def _paths(directory: str | os.PathLike[str]) -> tuple[Path, Path, Path]:
    target = Path(directory)
    return target, target.with_name(target.name + ".tmp"), target.with_name(target.name + ".old")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _save_target_problem(target: Path, tmp: Path, old: Path) -> str | None:
    """Why saving to ``target`` would destroy something that is not a checkpoint, or None."""
    if target.exists() and not target.is_dir():
        return (
            f"{target} is a file, not a checkpoint directory; saving would move it aside and "
            "delete it. Pass a new directory path (or remove the file yourself)"
        )
    if target.is_dir() and not _complete(target) and any(target.iterdir()):
        return (
            f"{target} is a non-empty directory that is not a checkpoint (no {_MARKER} marker); "
            "saving would replace it and delete its contents. Pass a new directory path"
        )
    for path in (tmp, old):
        if path.exists() and not path.is_dir():
            return f"{path} is a file; a save to {target} needs that path. Move the file away"
    return None


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any = None,
    engine_state: dict[str, int] | None = None,
    extra_state: Any = None,
) -> None:
    """Save a checkpoint atomically (collective: every rank calls it with the same directory).

    Every rank checksums the files it wrote; rank 0 records them all in the marker.

    Args:
        directory: where the checkpoint lives once complete: a new path, an empty directory,
            or an earlier checkpoint (replaced atomically).
        model: plain module, DDP or FSDP2 model (sharded state is saved shard by shard).
        optimizer: its optimizer.
        lr_scheduler: saved with ``state_dict()`` when given.
        engine_state: Engine counters (:meth:`Engine.state_dict`).
        extra_state: any picklable per-rank object (e.g. a data loader's state).

    Raises:
        FileExistsError: on every rank, when ``directory`` is a file or a non-empty directory
            that is not a checkpoint (nothing is written or moved).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = _rank_world()
    target, tmp, old = _paths(directory)
    refusal = _save_target_problem(target, tmp, old) if rank == 0 else None
    _raise_agreed(_all_gather(None if refusal is None else ("exists", str(target), [refusal])))
    if rank == 0:
        if tmp.exists():
            logger.warning("removing the leftover of an interrupted save at %s", tmp)
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    # Expert-parallel shards become DTensors over the ep group: every rank's experts are kept.
    model_state, optim_state = checkpoint_views(model, *get_state_dict(model, optimizer))
    dcp.save(
        {"model": model_state, "optim": optim_state},
        checkpoint_id=str(tmp / _DCP_DIR),
        no_dist=not _distributed(),
    )
    rank_file = tmp / f"rank_{rank:05d}.pt"
    torch.save({"rng": rng_state(), "extra": extra_state}, rank_file)
    _fsync_file(rank_file)
    if rank == 0:
        meta = {
            "format": _FORMAT_VERSION,
            "world_size": world,
            "engine": dict(engine_state or {}),
            "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
        }
        torch.save(meta, tmp / _META)
        _fsync_file(tmp / _META)
    # Each rank hashes what it wrote (in parallel, while it is in the page cache). The
    # gather doubles as the barrier: every file is written before the marker and the rename.
    own = files_written_by(tmp, rank, dcp_dir=_DCP_DIR)
    if rank == 0:
        own += [p for p in (tmp / _META, tmp / _DCP_DIR / ".metadata") if p.is_file()]
    try:
        report: Any = checksum_files(tmp, own)
    except OSError as err:
        report = ("error", str(tmp), [f"rank {rank} could not read back what it wrote: {err}"])
    reports = _all_gather(report)
    _raise_agreed([r if isinstance(r, tuple) else None for r in reports])
    if rank == 0:
        files: dict[str, Any] = {}
        for part in reports:
            files.update(part)
        unclaimed = [
            p
            for p in sorted(tmp.rglob("*"))
            if p.is_file() and p.relative_to(tmp).as_posix() not in files
        ]
        if unclaimed:  # DCP named a file in a way files_written_by does not know
            files.update(checksum_files(tmp, unclaimed))
        marker = {
            "world_size": world,
            **dict(engine_state or {}),
            "format": _FORMAT_VERSION,
            "checksum": ALGORITHM,
            "files": files,
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True))
        _fsync_file(tmp / _MARKER)
        if target.exists():
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
        tmp.rename(target)
        if old.exists():
            shutil.rmtree(old)
    _barrier()


def _complete(path: Path) -> bool:
    return (path / _MARKER).is_file()


def _resolve(directory: str | os.PathLike[str]) -> Path:
    """The directory to read: ``directory``, or ``<dir>.old`` after an interrupted swap."""
    target, tmp, old = _paths(directory)
    if _complete(target):
        return target
    if not target.exists() and _complete(old):
        logger.warning("%s is missing after an interrupted save; loading %s", target, old)
        return old
    hint = f" ({tmp} is an interrupted save)" if tmp.exists() else ""
    raise FileNotFoundError(
        f"no complete checkpoint at {target}{hint}: the {_MARKER} marker is missing; "
        "pass the directory of a finished save_checkpoint() (see latest_checkpoint())"
    )


def _read_marker(path: Path) -> dict[str, Any]:
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _Corrupt([f"{path / _MARKER}: unreadable ({type(err).__name__}: {err})"]) from err
    if not isinstance(marker, dict):
        raise _Corrupt([f"{path / _MARKER}: not a JSON object"])
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
    meta = _torch_load(path / _META)
    if not isinstance(meta, dict) or meta.get("format") not in _READABLE_FORMATS:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(
            f"checkpoint format {found} at {path} is not one of the supported "
            f"{_READABLE_FORMATS}; it was written by another version of train-engine"
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
    and restored only when the world size is unchanged.

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
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = _rank_world()
    failure: _Failure = None
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
    _raise_agreed(_all_gather(failure))
    if meta["lr_scheduler"] is None and lr_scheduler is not None:
        raise ValueError(f"the checkpoint at {path} holds no scheduler state to load")
    model_state, optim_state = get_state_dict(model, optimizer)
    # DCP loads in place into the tensors of these dicts (expert shards through DTensor views
    # of the same storage, resharded from whatever ep layout saved them).
    model_view, optim_view = checkpoint_views(model, model_state, optim_state)
    try:
        dcp.load(
            {"model": model_view, "optim": optim_view},
            checkpoint_id=str(path / _DCP_DIR),
            no_dist=not _distributed(),
        )
    except Exception as err:
        # Only reachable unverified (format 1, or verify=False); DCP agrees on its failures.
        raise CheckpointCorruptError(
            path, [f"{path / _DCP_DIR}: could not be read ({type(err).__name__}: {err})"]
        ) from err
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
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
    return LoadedCheckpoint(engine_state=meta["engine"], extra_state=extra, path=path)


def _resolve_quietly(directory: str | os.PathLike[str]) -> Path:
    try:
        return _resolve(directory)
    except FileNotFoundError:
        return Path(directory)


def _marker_steps(path: Path) -> int:
    try:
        return int(json.loads((path / _MARKER).read_text()).get("optimizer_steps", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        logger.warning("unreadable %s marker in %s: listed last", _MARKER, path)
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
        if child.name.endswith(".tmp") or not _complete(child):
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
