"""Skipped steps: runs that stopped learning, and the error that ends such a run.

The Engine skips an optimizer update whose global gradient norm is non-finite, or whose window
trained no token (the decision is agreed over all ranks). A run whose every update is skipped
would still "finish", so the recipe records which steps were skipped (for metrics.jsonl and the
summary; saved in checkpoints, so the record and the run of skips continue across a resume),
prints one line per skip on rank 0 (in place of the Engine's warning, which every rank logs),
aborts after ``train.max_consecutive_skips`` in a row and refuses to export a run whose every
step was skipped. With a fused optimizer the skip flag is decided on the device:
:class:`SkipTracker` reads each step's flag one step late, when the Engine has already settled
it, so tracking adds no host synchronisation.

Ranks that stopped running: :mod:`train_recipes.loop.hang_watchdog`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from train_engine import StepResult

__all__ = [
    "SkipTracker",
    "TrainingAborted",
    "engine_skip_warnings_replaced",
]


class TrainingAborted(RuntimeError):
    """The run cannot usefully continue.

    Raised on every rank at the same step (the decision rests on agreed values), with a
    one-line message for the user.
    """


class SkipTracker:
    """Records the optimizer steps skipped, by the recipe's step number, across resumes.

    A step is skipped for a non-finite gradient norm or because it trained no token (every
    label of its batches masked; the Engine skips it, so weight decay does not move the
    weights). The run of skips in a row is the Engine's (each result's
    ``consecutive_skipped_steps``) plus the run a resumed checkpoint ended with
    (:meth:`state_dict`); this class only names the steps and decides when to abort.

    Args:
        max_consecutive: abort after this many skipped steps in a row; 0 never aborts.
        on_skip: called with each skipped step's number and whether it trained no token (rank
            0 prints it).
        no_token_hint: what to check when steps train no token (the recipe's data keys).
    """

    def __init__(
        self,
        max_consecutive: int,
        *,
        on_skip: Callable[[int, bool], None],
        no_token_hint: str = "check the data's labels",
    ) -> None:
        self.max_consecutive = max_consecutive
        self.skipped: list[int] = []
        self.empty: list[int] = []  # the skipped steps that trained no token
        self._on_skip = on_skip
        self._hint = no_token_hint
        self._pending: tuple[int, StepResult] | None = None
        self._reported = 0
        self._carried = 0  # skips in a row at the resumed checkpoint, until the next update
        self._in_a_row = 0

    def observe(self, step: int, result: StepResult) -> None:
        """Take step ``step``'s result; account the previous step's (settled by now).

        Raises:
            TrainingAborted: ``max_consecutive`` skipped steps in a row.
        """
        pending, self._pending = self._pending, (step, result)
        if pending is not None:
            self._account(*pending)

    def flush(self) -> None:
        """Account the held result now (reads its flag: a host sync on a fused optimizer)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._account(*pending)

    def new_since_last_call(self) -> list[int]:
        """Skipped steps accounted since the previous call (for one metrics record)."""
        out = self.skipped[self._reported :]
        self._reported = len(self.skipped)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The skipped steps and the run of skips so far (call :meth:`flush` first)."""
        return {
            "skipped": list(self.skipped),
            "empty": list(self.empty),
            "in_a_row": self._in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state_dict` (before the first step)."""
        self.skipped = [int(s) for s in state["skipped"]]
        self.empty = [int(s) for s in state["empty"]]
        self._carried = self._in_a_row = int(state["in_a_row"])
        self._reported = len(self.skipped)

    def check_trained(self, steps: int) -> None:
        """Refuse a run of ``steps`` steps whose every step was skipped: it trained nothing.

        Raises:
            TrainingAborted: every step skipped; the message names the cause.
        """
        if steps <= 0 or len(self.skipped) < steps:
            return
        raise TrainingAborted(
            f"none of the run's {steps} steps updated the model: {self._cause(self.skipped)}; "
            "nothing was exported"
        )

    def _cause(self, steps: list[int]) -> str:
        empty = len(set(steps) & set(self.empty))
        if empty == len(steps):
            return f"they trained no token (every label masked), {self._hint}"
        if empty == 0:
            return (
                "their gradients were non-finite; lower optim.lr or check the data "
                "(optim.nonfinite decides what a non-finite step does)"
            )
        return (
            f"{empty} trained no token (every label masked: {self._hint}) and "
            f"{len(steps) - empty} had non-finite gradients (lower optim.lr or check the data)"
        )

    def _account(self, step: int, result: StepResult) -> None:
        if not result.skipped:
            self._carried = self._in_a_row = 0
            return
        self.skipped.append(step)
        empty = result.no_loss_tokens
        if empty:
            self.empty.append(step)
        self._on_skip(step, empty)
        in_a_row = self._in_a_row = result.consecutive_skipped_steps + self._carried
        if self.max_consecutive and in_a_row >= self.max_consecutive:
            first = step - in_a_row + 1
            raise TrainingAborted(
                f"steps {first}-{step}: {in_a_row} optimizer steps in a row were skipped "
                f"(train.max_consecutive_skips={self.max_consecutive}): "
                f"{self._cause(self.skipped[-in_a_row:])}; the run stopped learning. "
                "Set train.max_consecutive_skips=0 to run on"
            )


class _DropEngineSkipWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("skipped the update of step")


@contextmanager
def engine_skip_warnings_replaced() -> Iterator[None]:
    """Drop train-engine's skip warnings while the recipe reports skips itself.

    The Engine logs each skip on every rank (a 64-rank job prints 64 lines per skip, around the
    progress bar); the recipe prints one line on rank 0, above the bar, with the same step.
    """
    engine_logger = logging.getLogger("train_engine.engine")
    drop = _DropEngineSkipWarnings()
    engine_logger.addFilter(drop)
    try:
        yield
    finally:
        engine_logger.removeFilter(drop)
