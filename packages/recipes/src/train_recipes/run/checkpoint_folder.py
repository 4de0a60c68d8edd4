"""The checkpoints of a run folder: their names, which are complete, and which go.

``checkpoints/step_NNNNNN`` holds the checkpoint of step N (train-engine's layout, with its
``.tmp``/``.old`` leftovers of an interrupted save); ``checkpoints/damaged/`` holds the ones a
resume could not load, kept for the user to repair or delete (no listing or pruning reads it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from train_recipes.run.folder import CHECKPOINT_DIR

__all__ = [
    "DAMAGED_DIR",
    "checkpoint_dir",
    "complete_checkpoints",
    "prune",
    "set_aside_newer",
    "step_of",
]

#: Where a resume moves the checkpoints that did not load (under ``checkpoints/``).
DAMAGED_DIR = "damaged"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """``<output_dir>/checkpoints/step_NNNNNN``."""
    return Path(output_dir) / CHECKPOINT_DIR / f"step_{step:06d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The run's complete checkpoints, newest first (train-engine's marker check)."""
    from train_engine import complete_checkpoints as engine_complete_checkpoints

    return engine_complete_checkpoints(Path(output_dir) / CHECKPOINT_DIR)


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder's name (``step_NNNNNN[.tmp|.old]``), else None."""
    base = name.removesuffix(".tmp").removesuffix(".old")
    if not base.startswith("step_") or not base[5:].isdigit():
        return None
    return int(base[5:])


def prune(output_dir: Path, *, keep: int, upto: int) -> None:
    """Keep the newest ``keep`` checkpoints of steps <= ``upto``.

    Never a higher step: those are not this timeline's and were set aside at resume.
    """
    if keep <= 0:
        return
    root = output_dir / CHECKPOINT_DIR
    entries = [(s, p) for p in root.iterdir() if (s := step_of(p.name)) is not None and s <= upto]
    kept = sorted({s for s, _ in entries}, reverse=True)[:keep]
    for step, path in entries:
        if step not in kept:
            shutil.rmtree(path, ignore_errors=True)


def set_aside_newer(output_dir: Path, step: int) -> list[str]:
    """Move the checkpoints newer than the one resumed from to ``checkpoints/damaged/`` (rank 0).

    They exist only because they did not load (a corrupt or missing file, a lost marker): a
    reader would otherwise take them first, and a later save of their step would refuse
    their folder. They are kept, never deleted (the files may be repairable, e.g. on a network
    filesystem that lost them for a moment); an interrupted save without its marker (a
    ``.tmp`` folder, never a checkpoint) is removed.

    Returns:
        The moved names.
    """
    root = output_dir / CHECKPOINT_DIR
    moved = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        found = step_of(path.name)
        if found is None or found <= step:
            continue
        # train-engine's marker, written last: without it a .tmp folder holds a partial save.
        if path.name.endswith(".tmp") and not (path / "COMPLETE").is_file():
            shutil.rmtree(path, ignore_errors=True)
            continue
        (root / DAMAGED_DIR).mkdir(exist_ok=True)
        target = root / DAMAGED_DIR / path.name
        n = 1
        while target.exists():  # an earlier resume set aside a checkpoint of the same step
            n += 1
            target = root / DAMAGED_DIR / f"{path.name}-{n}"
        path.rename(target)
        moved.append(path.name)
    return moved
