"""The Engine's update counters, and the skip accounting of device-decided updates.

With a fused optimizer the skip flag of an update is still on its way to the host when
``step()`` returns, so the update is counted optimistically and corrected when the flag is
read (:meth:`UpdateCounters.settle`). The counters are the one owner of "how many updates,
how many skipped, how many skipped in a row": a training loop reads them from the Engine or
from each :class:`~train_engine.StepResult`, never counts them again.
"""

from __future__ import annotations

import logging

from train_engine._device_update import PendingUpdate

__all__ = ["UpdateCounters"]

# The Engine's logger: skip warnings keep the name users filter on ("train_engine.engine").
logger = logging.getLogger("train_engine.engine")


class UpdateCounters:
    """Updates made, windows skipped (in total and in a row) and windows ended.

    Attributes:
        optimizer_steps: updates made (a device-decided one counted until its flag says skip).
        skipped_steps: windows skipped (non-finite gradient norm, or no loss tokens).
        windows: windows ended, skipped ones included (the step number a loop shows, minus 1).
        consecutive_skipped: windows skipped in a row since the last update (not saved).
        pending: the last device-decided update whose skip flag is not read yet, or None.
    """

    __slots__ = (
        "_pending_window",
        "consecutive_skipped",
        "optimizer_steps",
        "pending",
        "skipped_steps",
        "windows",
    )

    def __init__(self) -> None:
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.windows = 0
        self.consecutive_skipped = 0
        self.pending: PendingUpdate | None = None
        self._pending_window = 0  # the window of the pending update, for its warning

    def settle(self) -> None:
        """Account for the pending device-decided update (reads its flag: waits for the norm)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if pending.resolve():
            self.optimizer_steps -= 1
            self.count_skip(self._pending_window, decided="on the device", empty=pending.empty)
        else:
            self.consecutive_skipped = 0

    def count_update(self, pending: PendingUpdate | None) -> None:
        """Count an update; ``pending`` when its skip flag is still on the device."""
        self.optimizer_steps += 1
        self.pending = pending
        if pending is None:
            self.consecutive_skipped = 0
        else:
            self._pending_window = self.windows + 1

    def count_skip(
        self, window: int, *, decided: str, log: bool = True, empty: bool = False
    ) -> None:
        """Count a skipped window and log it under the step number a training loop shows.

        ``empty``: the window had no loss tokens (else its gradient norm was non-finite).
        """
        self.skipped_steps += 1
        self.consecutive_skipped += 1
        if not log:
            return
        logger.warning(
            "skipped the update of step %d (accumulation window %d, skipped ones counted): "
            "%s, decided %s; %d optimizer updates so far, %d skipped in total, %d in a row",
            window,
            window,
            "no loss tokens in the window" if empty else "non-finite global gradient norm",
            decided,
            self.optimizer_steps,
            self.skipped_steps,
            self.consecutive_skipped,
        )

    def drop_pending(self) -> None:
        """Forget the pending update's flag: a loaded state replaced what it would correct.

        Reading it would roll the scheduler back to its pre-update snapshot, over whatever was
        just loaded (also when a StepResult still holding it is read later).
        """
        if self.pending is not None:
            self.pending.detach()
            self.pending = None

    def state_dict(self) -> dict[str, int]:
        """The saved counters (settle first)."""
        return {
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "windows": self.windows,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`'s counters; the run of skips restarts at 0."""
        self.drop_pending()
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.windows = int(state["windows"])
        self.consecutive_skipped = 0
