"""A checkpoint save that fails ends the run with one line, and keeps the final weights if it can.

train-engine reports a failed save (a full disk, any OS error, on any rank) as
``CheckpointWriteError`` on every rank together, after removing the partial ``step_N.tmp``;
the checkpoints already on disk are untouched. The recipe then stops on every rank
(:class:`~train_recipes.run.health.TrainingAborted`: one line, exit 1, no traceback) before
``keep_checkpoints`` prunes anything, so the previous complete checkpoint stays for
``--resume``. At the last step a full checkpoint that cannot be written is followed by the
weights alone (no optimizer state: a seventh of the size for bf16 weights with fp32 master
weights), so the trained model is not lost when that fits; the line says what was kept.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from train_recipes.run.health import TrainingAborted
from train_recipes.run.storage import size_text

if TYPE_CHECKING:
    from train_engine import CheckpointWriteError, Engine

__all__ = ["save_or_abort"]

# Out of space, or over a quota.
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _fix(err: CheckpointWriteError) -> str:
    if err.errno in _FULL:
        return (
            "free space there (or set train.checkpoint_optimizer=false, fewer "
            "train.keep_checkpoints or another train.output_dir)"
        )
    return "fix the cause named above"


def _newest(root: Path) -> str:
    from train_engine import complete_checkpoints

    found = complete_checkpoints(root)
    return f"the newest complete checkpoint is {found[0].name}" if found else "none is complete"


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_or_abort(
    engine: Engine,
    target: Path,
    *,
    extra_state: Mapping[str, object],
    optimizer_state: bool,
    final: bool,
) -> None:
    """Save a checkpoint; on failure stop the run on every rank with one line (collective).

    Args:
        engine: the Engine.
        target: the checkpoint directory (``<run>/checkpoints/step_NNNNNN``).
        extra_state: this rank's extra state; ``optimizer_state`` is recorded in it, so that a
            resume can say it restarts the optimizer.
        optimizer_state: save the optimizer's state (``train.checkpoint_optimizer``).
        final: the run's last step: a failed full save is followed by the weights alone.

    Raises:
        TrainingAborted: on every rank when the save failed, naming the folder, the OS error,
            the bytes written and free, what was kept and how to continue.
    """
    from train_engine import CheckpointWriteError

    try:
        engine.save_checkpoint(
            target,
            extra_state={**extra_state, "optimizer_state": optimizer_state},
            optimizer_state=optimizer_state,
        )
        return
    except CheckpointWriteError as err:
        failed = err
    if not final:
        raise TrainingAborted(
            f"{failed}; {_newest(target.parent)}: {_fix(failed)} and continue with --resume"
        ) from None
    kept: CheckpointWriteError | None = None
    if optimizer_state:
        try:
            engine.save_checkpoint(
                target, extra_state={**extra_state, "optimizer_state": False}, optimizer_state=False
            )
        except CheckpointWriteError as err:
            kept = err
        else:
            run = target.parent.parent
            raise TrainingAborted(
                f"{failed}; kept the final weights without optimizer state in {target.name} "
                f"instead ({size_text(_size(target))}): `train-recipes export {run}` "
                "writes the Hugging Face model from it, and --resume continues from it with "
                "AdamW restarted"
            ) from None
    lost = f"; the weights alone could not be saved either ({kept.reason})" if kept else ""
    raise TrainingAborted(
        f"{failed}{lost}: the final weights are lost, {_newest(target.parent)}; {_fix(failed)} "
        "and rerun the last steps with --resume"
    ) from None
