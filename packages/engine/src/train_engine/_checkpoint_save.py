"""Saving a checkpoint: written beside, checksummed, swapped in; a failure removes it.

See :mod:`train_engine.checkpoint` for the layout. Every rank writes its DCP shards and its own
file into ``<dir>.tmp`` and checksums them; rank 0 writes the marker and renames. A failure on
any rank (a full disk, any OS error) is gathered like every other decision: rank 0 measures
what was written and the free space, removes ``<dir>.tmp``, and every rank raises the same
:class:`CheckpointWriteError`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from train_engine._checkpoint_common import (
    DCP_DIR,
    FORMAT_VERSION,
    MARKER,
    META,
    all_gather,
    distributed,
    fsync_file,
    is_complete,
    paths,
    raise_agreed,
    rank_world,
)
from train_engine._checksums import ALGORITHM, checksum_files, files_written_by
from train_engine._rng import rng_state
from train_engine._save_errors import (
    FULL_BELOW,
    describe_failure,
    format_size,
    free_disk_bytes,
    tree_bytes,
)
from train_engine.expert_parallel import checkpoint_views

__all__ = ["CheckpointWriteError", "save_checkpoint"]

logger = logging.getLogger(__name__)


class CheckpointWriteError(RuntimeError):
    """A save failed; raised by :func:`~train_engine.save_checkpoint` on every rank together.

    The partial save (``<dir>.tmp``) was removed and nothing else changed: a checkpoint already
    at the directory, and every other one, is as it was. The message is one line.

    Attributes:
        checkpoint: the checkpoint directory the save was for.
        errno: the OS error's number (``errno.ENOSPC`` for a full disk, also when torch's
            writer lost it and the disk was found full), None for another failure.
        reason: the OS error (or the failure) in a few words.
        bytes_written: what the save had written, over all ranks, when it failed.
        bytes_free: free bytes on the checkpoint's filesystem at the failure (None: unknown).
    """

    def __init__(
        self,
        message: str,
        *,
        checkpoint: Path | None = None,
        errno: int | None = None,
        reason: str = "",
        bytes_written: int = 0,
        bytes_free: int | None = None,
    ) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.errno = errno
        self.reason = reason
        self.bytes_written = bytes_written
        self.bytes_free = bytes_free


def _save_target_problem(target: Path, tmp: Path, old: Path) -> str | None:
    """Why saving to ``target`` would destroy something that is not a checkpoint, or None."""
    if target.exists() and not target.is_dir():
        return (
            f"{target} is a file, not a checkpoint directory; saving would move it aside and "
            "delete it. Pass a new directory path (or remove the file yourself)"
        )
    if target.is_dir() and not is_complete(target) and any(target.iterdir()):
        return (
            f"{target} is a non-empty directory that is not a checkpoint (no {MARKER} marker); "
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
    optimizer_state: bool = True,
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
        optimizer_state: False leaves the optimizer's state out (for AdamW with fp32 master
            weights that is 6x the size of bf16 weights); :func:`~train_engine.load_checkpoint` then
            restarts the optimizer from the loaded weights.

    Raises:
        FileExistsError: on every rank, when ``directory`` is a file or a non-empty directory
            that is not a checkpoint (nothing is written or moved).
        CheckpointWriteError: on every rank, when writing failed on any rank (a full disk or
            another OS error); the partial save was removed, nothing else changed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    rank, world = rank_world()
    target, tmp, old = paths(directory)
    start: Any = None
    if rank == 0:
        refusal = _save_target_problem(target, tmp, old)
        start = None if refusal is None else ("exists", str(target), [refusal])
        if refusal is None:
            try:
                if tmp.exists():
                    logger.warning("removing the leftover of an interrupted save at %s", tmp)
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as err:
                start = _write_failure(err)
    # The gather doubles as the barrier: no rank writes before the directory exists.
    started = all_gather(start)
    raise_agreed([s if s is None or s[0] != "write" else None for s in started])
    _raise_write_failures(started, target, tmp, rank)
    # Expert-parallel shards become DTensors over the ep group: every rank's experts are kept.
    if optimizer_state:
        model_state, optim_state = checkpoint_views(model, *get_state_dict(model, optimizer))
        to_save = {"model": model_state, "optim": optim_state}
    else:
        to_save = {"model": checkpoint_views(model, get_model_state_dict(model), {})[0]}
    failure: BaseException | None = None
    report: Any = None
    try:
        dcp.save(to_save, checkpoint_id=str(tmp / DCP_DIR), no_dist=not distributed())
        rank_file = tmp / f"rank_{rank:05d}.pt"
        torch.save({"rng": rng_state(), "extra": extra_state}, rank_file)
        fsync_file(rank_file)
        if rank == 0:
            meta = {
                "format": FORMAT_VERSION,
                "world_size": world,
                "engine": dict(engine_state or {}),
                "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
                "optimizer_state": optimizer_state,
            }
            torch.save(meta, tmp / META)
            fsync_file(tmp / META)
        # Each rank hashes what it wrote (in parallel, while it is in the page cache).
        own = files_written_by(tmp, rank, dcp_dir=DCP_DIR)
        if rank == 0:
            own += [p for p in (tmp / META, tmp / DCP_DIR / ".metadata") if p.is_file()]
        report = checksum_files(tmp, own)
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        failure = err
    # The gather doubles as the barrier: every file is written before the marker and rename.
    reports = all_gather(report if failure is None else _write_failure(failure))
    _raise_write_failures(reports, target, tmp, rank)
    failure = None
    if rank == 0:
        try:
            _publish(tmp, target, old, reports, world=world, engine_state=engine_state)
        except OSError as err:
            failure = err
    _raise_write_failures(all_gather(_write_failure(failure)), target, tmp, rank)


# A rank's failed write, as gathered: ("write", errno or None, the OS error in a few words,
# the rank DCP names as the origin or None).
_WriteFailure = tuple[str, int | None, str, int | None]


def _write_failure(err: BaseException | None) -> _WriteFailure | None:
    return None if err is None else ("write", *describe_failure(err))


def _raise_write_failures(reports: list[Any], target: Path, tmp: Path, rank: int) -> None:
    """After a gather: if any rank failed to write, remove ``tmp`` and raise on every rank.

    Rank 0 measures what was written and the free space before removing the partial save and
    sends the one message every rank raises.
    """
    failed = [(r, f) for r, f in enumerate(reports) if isinstance(f, tuple) and f[0] == "write"]
    if not failed:
        return
    first_rank, (_, code, reason, origin) = failed[0]
    error = None
    if rank == 0:
        written, free = tree_bytes(tmp), free_disk_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if code is None and free is not None and free < FULL_BELOW:
            code = errno.ENOSPC
            reason += "; the filesystem is full: ENOSPC (No space left on device)"
        where = f" [rank {first_rank if origin is None else origin}]" if len(reports) > 1 else ""
        shown_free = "an unknown amount" if free is None else format_size(free)
        error = CheckpointWriteError(
            f"could not save checkpoint {target}: {reason}{where}; {format_size(written)} "
            f"written to {tmp.name}, {shown_free} free on its filesystem; the partial save "
            "was removed",
            checkpoint=target,
            errno=code,
            reason=reason,
            bytes_written=written,
            bytes_free=free,
        )
    raise _from_rank0(error)


def _from_rank0(error: CheckpointWriteError | None) -> CheckpointWriteError:
    """Rank 0's error on every rank (a collective)."""
    if not distributed():
        assert error is not None
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def _publish(
    tmp: Path,
    target: Path,
    old: Path,
    reports: list[Any],
    *,
    world: int,
    engine_state: dict[str, int] | None,
) -> None:
    """Rank 0: write the marker into ``tmp``, then swap it in for ``target``.

    On an OS error ``target`` is put back as it was (from ``old`` when it was moved aside).
    """
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
        "format": FORMAT_VERSION,
        "checksum": ALGORITHM,
        "files": files,
    }
    try:
        (tmp / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True))
        fsync_file(tmp / MARKER)
        if target.exists():
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
        tmp.rename(target)
    except OSError:
        if not target.exists() and old.exists():
            old.rename(target)
        raise
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
