"""Atomic, resumable checkpoints: model and optimizer through torch.distributed.checkpoint (DCP,
sharded for FSDP2/DTensor), plus scheduler, Engine counters, RNG states and caller state.

Layout of a checkpoint directory::

    <dir>/model_optim/      DCP files (every rank writes its shards)
    <dir>/meta.pt           rank 0: scheduler and Engine state
    <dir>/rank_00000.pt     per rank: RNG states and the caller's extra state
    <dir>/COMPLETE          JSON marker, written last

A save writes everything into ``<dir>.tmp`` and only then renames it to ``<dir>`` (a directory
that already exists is first moved aside to ``<dir>.old``), so an interrupted save never damages
the previous checkpoint; :func:`load_checkpoint` falls back to ``<dir>.old`` when a crash hit
between the two renames. All ranks must see the same filesystem.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["LoadedCheckpoint", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 1
_MARKER = "COMPLETE"
_DCP_DIR = "model_optim"
_META = "meta.pt"


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


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        state["numpy"] = np.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _paths(directory: str | os.PathLike[str]) -> tuple[Path, Path, Path]:
    target = Path(directory)
    return target, target.with_name(target.name + ".tmp"), target.with_name(target.name + ".old")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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

    Args:
        directory: where the checkpoint lives once complete.
        model: plain module, DDP or FSDP2 model (sharded state is saved shard by shard).
        optimizer: its optimizer.
        lr_scheduler: saved with ``state_dict()`` when given.
        engine_state: Engine counters (:meth:`Engine.state_dict`).
        extra_state: any picklable per-rank object (e.g. a data loader's state).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = _rank_world()
    target, tmp, old = _paths(directory)
    if rank == 0:
        if tmp.exists():
            logger.warning("removing the leftover of an interrupted save at %s", tmp)
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optim": optim_state},
        checkpoint_id=str(tmp / _DCP_DIR),
        no_dist=not _distributed(),
    )
    rank_file = tmp / f"rank_{rank:05d}.pt"
    torch.save({"rng": _rng_state(), "extra": extra_state}, rank_file)
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
    _barrier()  # every rank's files are written before the marker and the rename
    if rank == 0:
        marker = {"world_size": world, **{k: v for k, v in (engine_state or {}).items()}}
        (tmp / _MARKER).write_text(json.dumps(marker))
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


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any = None,
) -> LoadedCheckpoint:
    """Load a checkpoint written by :func:`save_checkpoint` (collective).

    Model and optimizer are resharded by DCP if the parallel layout changed; RNG states and
    extra state are per rank and restored only when the world size is unchanged.

    Raises:
        FileNotFoundError: no complete checkpoint at ``directory`` (nor at ``<dir>.old``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = _rank_world()
    target, tmp, old = _paths(directory)
    if _complete(target):
        path = target
    elif not target.exists() and _complete(old):
        logger.warning("%s is missing after an interrupted save; loading %s", target, old)
        path = old
    else:
        hint = f" ({tmp} is an interrupted save)" if tmp.exists() else ""
        raise FileNotFoundError(
            f"no complete checkpoint at {target}{hint}: the {_MARKER} marker is missing; "
            "pass the directory of a finished save_checkpoint() (see latest_checkpoint())"
        )
    meta = torch.load(path / _META, weights_only=False)
    if meta.get("format") != _FORMAT_VERSION:
        raise ValueError(
            f"checkpoint format {meta.get('format')} at {path} is not the supported {_FORMAT_VERSION}"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    # DCP loads in place into the tensors of these dicts.
    dcp.load(
        {"model": model_state, "optim": optim_state},
        checkpoint_id=str(path / _DCP_DIR),
        no_dist=not _distributed(),
    )
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    if lr_scheduler is not None:
        if meta["lr_scheduler"] is None:
            raise ValueError(f"the checkpoint at {path} holds no scheduler state to load")
        lr_scheduler.load_state_dict(meta["lr_scheduler"])
    extra = None
    if meta["world_size"] == world:
        per_rank = torch.load(path / f"rank_{rank:05d}.pt", weights_only=False)
        _set_rng_state(per_rank["rng"])
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


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint directory under ``root`` with the most optimizer steps.

    Interrupted saves (``*.tmp``) are ignored; a ``<dir>.old`` left by a crash during the swap
    is returned as ``<dir>`` (which :func:`load_checkpoint` resolves). None when there is none.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, str] | None = None
    found: Path | None = None
    for child in root.iterdir():
        if child.name.endswith(".tmp") or not _complete(child):
            continue
        name = child.name.removesuffix(".old")
        steps = int(json.loads((child / _MARKER).read_text()).get("optimizer_steps", -1))
        key = (steps, name)
        if best is None or key > best:
            best, found = key, root / name
    return found
