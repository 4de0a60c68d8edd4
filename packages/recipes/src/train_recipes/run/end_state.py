"""How far a run's end got: training, the final checkpoint, the export and the summary.

A run ends in stages (the last step's checkpoint, the held-out evaluation and the Hugging Face
export, then ``summary.json``), and a job can be stopped between any two of them. The main
process records each stage in ``state.json`` (replaced whole, never half-written) for the run
length it belongs to, so that a resume can tell a finished run from one whose end was
interrupted: the latter has its final checkpoint but lacks the export or the summary, and
``--resume`` finishes what is missing instead of reporting the run as finished.

A run folder written before this file existed has none: its end counts as done when
``summary.json`` exists and, with the export asked for, ``hf_model`` too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from train_recipes.run.folder import EXPORT_DIR, STATE_FILE, write_atomic

__all__ = [
    "EndRecorder",
    "EndState",
    "missing_end",
    "read_end_state",
    "run_finished",
    "write_end_state",
]

SUMMARY_FILE = "summary.json"


@dataclass(kw_only=True, slots=True, frozen=True)
class EndState:
    """The stages of a run's end that finished, for a run of ``steps`` steps.

    Attributes:
        steps: the run length (``train.steps``) the stages below belong to.
        trained: every step ran.
        final_checkpoint: the last step's checkpoint was written.
        exported: the Hugging Face export was published (False also when not asked for).
        summary: ``summary.json`` was written.
    """

    steps: int
    trained: bool = False
    final_checkpoint: bool = False
    exported: bool = False
    summary: bool = False

    def advanced(self, **done: bool) -> EndState:
        """This state with the given stages set."""
        return dataclasses.replace(self, **done)


def read_end_state(output_dir: str | Path) -> EndState | None:
    """The recorded state, or None when the folder has none (or an unreadable one)."""
    path = Path(output_dir) / STATE_FILE
    try:
        fields = json.loads(path.read_text())
        return EndState(**fields)
    except (OSError, ValueError, TypeError):
        return None


def write_end_state(output_dir: str | Path, state: EndState) -> None:
    """Record ``state`` (main process only; replaced whole)."""
    write_atomic(Path(output_dir) / STATE_FILE, json.dumps(dataclasses.asdict(state), indent=1))


class EndRecorder:
    """Records each stage of a run's end in ``state.json`` as it finishes.

    Args:
        output_dir: the run folder.
        steps: the run length.
        start_step: the step the job starts from (its last step done: training and the
            final checkpoint are done when it is ``steps``, a resume of an interrupted end).
        enabled: the main process writes; elsewhere every call is a no-op.
    """

    def __init__(self, output_dir: Path, *, steps: int, start_step: int, enabled: bool) -> None:
        self._dir = output_dir
        self._enabled = enabled
        done = start_step >= steps
        self._state = EndState(steps=steps, trained=done, final_checkpoint=done)
        self._write()

    def record(self, **done: bool) -> None:
        """Record the stages just finished (``trained=True``, ``exported=...``, ...)."""
        self._state = self._state.advanced(**done)
        self._write()

    def _write(self) -> None:
        if self._enabled:
            write_end_state(self._dir, self._state)


def missing_end(output_dir: str | Path, *, steps: int, export: bool) -> list[str]:
    """What a run trained to its last step (``steps``) still lacks at its end.

    Args:
        output_dir: the run folder.
        steps: the run length whose last step's checkpoint exists.
        export: the Hugging Face export is asked for (``train.export``).

    Returns:
        ``["the export", "the summary"]`` or part of it; empty when the end is complete.
    """
    out = Path(output_dir)
    state = read_end_state(out)
    has_export = (out / EXPORT_DIR).is_dir()
    has_summary = (out / SUMMARY_FILE).is_file()
    if state is not None:  # the files alone may be an earlier, shorter run's
        same_run = state.steps == steps
        has_export = has_export and same_run and state.exported
        has_summary = has_summary and same_run and state.summary
    missing = []
    if export and not has_export:
        missing.append("the export")
    if not has_summary:
        missing.append("the summary")
    return missing


def run_finished(output_dir: str | Path, *, trained_to: int, steps: int, export: bool) -> bool:
    """Whether a resume has nothing left to do.

    Args:
        output_dir: the run folder.
        trained_to: the step of its newest checkpoint.
        steps: the run length asked for (``train.steps``).
        export: the Hugging Face export is asked for.

    Returns:
        True when it trained past ``steps``, or to ``steps`` with its end complete.
    """
    if trained_to != steps:
        return trained_to > steps
    return not missing_end(output_dir, steps=steps, export=export)
