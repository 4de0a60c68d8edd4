"""What one :meth:`Engine.step` call did (its skip flag possibly still on the device)."""

from __future__ import annotations

from torch import Tensor

from train_engine._device_update import PendingUpdate

__all__ = ["StepResult"]


class StepResult:
    """What one :meth:`Engine.step` call did.

    Attributes:
        updated: the optimizer (and scheduler) stepped.
        skipped: a window ended but its update was skipped: its gradient norm was non-finite,
            or it had no loss tokens (contract (b) with ``num_tokens`` 0).
        no_loss_tokens: the window was skipped because it had no loss tokens (nothing to
            learn from; an update would still move the weights through weight decay).
        grad_norm: global gradient norm before clipping, a 0-dim float64 device tensor (read
            it with ``float()`` when you need it on the host); None off the boundary.
        lrs: learning rate of each optimizer parameter group used by this update (the rates in
            force at this call when nothing was updated).
        optimizer_steps: number of optimizer updates done so far, this one included.
        consecutive_skipped_steps: windows skipped in a row up to this call (0 after an
            update; off the boundary, as of the last window). The Engine's count: a loop that
            aborts after N skips in a row reads it here instead of counting skips again.

    With a fused optimizer and ``nonfinite="skip"`` the skip is decided on the device;
    ``updated``, ``skipped``, ``no_loss_tokens``, ``optimizer_steps`` and
    ``consecutive_skipped_steps`` then read
    its flag when first accessed (which waits for the gradient norm, not for the update).
    """

    __slots__ = (
        "_consecutive_before",
        "_consecutive_pending",
        "_no_loss_tokens",
        "_optimizer_steps",
        "_pending",
        "_skipped",
        "_updated_without_pending",
        "grad_norm",
        "lrs",
    )

    def __init__(
        self,
        *,
        updated: bool,
        skipped: bool,
        grad_norm: Tensor | None,
        lrs: tuple[float, ...],
        optimizer_steps: int,
        consecutive_skipped: int,
        pending: PendingUpdate | None = None,
        consecutive_pending: PendingUpdate | None = None,
        no_loss_tokens: bool = False,
    ) -> None:
        """Record one step() (see the class attributes).

        Args:
            updated: the optimizer stepped (optimistically, when ``pending`` is given).
            skipped: the window's update was skipped, decided on the host.
            grad_norm: the window's norm, or None off the boundary.
            lrs: the learning rates of this update.
            optimizer_steps: updates so far, counting a pending one as made.
            consecutive_skipped: skips in a row, not counting ``consecutive_pending``.
            pending: this window's update, when its skip flag is still on the device.
            consecutive_pending: the update whose flag still decides the run of skips (this
                window's ``pending`` at the boundary, the last window's off it), or None.
            no_loss_tokens: ``skipped`` because the window had no loss tokens (host-decided).
        """
        if updated and skipped:
            raise ValueError("a step cannot be both updated and skipped")
        self._skipped = skipped
        self._no_loss_tokens = no_loss_tokens
        self._optimizer_steps = optimizer_steps
        self._pending = pending
        self.grad_norm = grad_norm
        self.lrs = lrs
        self._updated_without_pending = updated
        self._consecutive_before = consecutive_skipped
        self._consecutive_pending = consecutive_pending

    @property
    def skipped(self) -> bool:
        """A window ended but its update was skipped (non-finite gradients, or no loss tokens)."""
        return self._skipped if self._pending is None else self._pending.resolve()

    @property
    def no_loss_tokens(self) -> bool:
        """The window was skipped because it had no loss tokens."""
        if self._pending is None:
            return self._no_loss_tokens
        return self._pending.resolve() and self._pending.empty

    @property
    def updated(self) -> bool:
        """The optimizer (and scheduler) stepped."""
        if self._pending is None:
            return self._updated_without_pending
        return not self._pending.resolve()

    @property
    def optimizer_steps(self) -> int:
        """Optimizer updates done so far, this one included."""
        return self._optimizer_steps - int(self._pending is not None and self._pending.resolve())

    @property
    def consecutive_skipped_steps(self) -> int:
        """Windows skipped in a row up to this call (0 after an update)."""
        pending = self._consecutive_pending
        if pending is None:
            return self._consecutive_before
        # The same rule as the Engine's own count once it reads the flag.
        return self._consecutive_before + 1 if pending.resolve() else 0

    def __repr__(self) -> str:
        return (
            f"StepResult(updated={self.updated}, skipped={self.skipped}, "
            f"grad_norm={self.grad_norm}, lrs={self.lrs}, optimizer_steps={self.optimizer_steps}, "
            f"consecutive_skipped_steps={self.consecutive_skipped_steps})"
        )
