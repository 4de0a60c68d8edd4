"""What saving and loading a checkpoint share: the directory layout and the ranks' agreement.

A checkpoint directory holds ``model_optim/`` (DCP files), ``meta.pt`` (rank 0),
``rank_NNNNN.pt`` (per rank) and the ``COMPLETE`` marker, written last (see
:mod:`train_engine.checkpoint`). Every decision that can differ between ranks (a refused target,
a failed write, a corrupt file) is gathered and raised on every rank alike, so none hangs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "DCP_DIR",
    "FORMAT_VERSION",
    "MARKER",
    "META",
    "READABLE_FORMATS",
    "CheckpointCorruptError",
    "Failure",
    "all_gather",
    "distributed",
    "fsync_file",
    "is_complete",
    "paths",
    "raise_agreed",
    "rank_world",
]

FORMAT_VERSION = 2  # 2: per-file checksums in the marker; 1: none
READABLE_FORMATS = (1, 2)
MARKER = "COMPLETE"
DCP_DIR = "model_optim"
META = "meta.pt"


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's files do not match what was saved, or cannot be read.

    Raised by :func:`~train_engine.load_checkpoint` on every rank together, before any state was changed,
    so the caller may load an earlier checkpoint instead (see :func:`~train_engine.complete_checkpoints`).

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


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    if distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a collective; just ``[obj]`` without a group)."""
    if not distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# None, or (kind, checkpoint directory, problem lines): what a rank reports to the others.
Failure = tuple[str, str, list[str]] | None


def raise_agreed(failures: list[Failure]) -> None:
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


def paths(directory: str | os.PathLike[str]) -> tuple[Path, Path, Path]:
    target = Path(directory)
    return target, target.with_name(target.name + ".tmp"), target.with_name(target.name + ".old")


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()
