"""What one :meth:`Engine.step` call did (its skip flag possibly still on the device)."""

from __future__ import annotations

from torch import Tensor

from train_engine._device_update import PendingUpdate

__all__ = ["StepResult"]


class StepResult:
    """What one :meth:`Engine.step` call did.

    Attributes:
        updated: the optimizer (and scheduler) stepped.
        skipped: a window ended but its update was skipped (non-finite gradients).
        grad_norm: global gradient norm before clipping, a 0-dim float64 device tensor (read
            it with ``float()`` when you need it on the host); None off the boundary.
        lrs: learning rate of each optimizer parameter group used by this update (the rates in
            force at this call when nothing was updated).
        optimizer_steps: number of optimizer updates done so far, this one included.

    With a fused optimizer and ``nonfinite="skip"`` the skip is decided on the device;
    ``updated``, ``skipped`` and ``optimizer_steps`` then read its flag when first accessed
    (which waits for the gradient norm, not for the update).
    """

    __slots__ = (
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
        pending: PendingUpdate | None = None,
    ) -> None:
        if updated and skipped:
            raise ValueError("a step cannot be both updated and skipped")
        self._skipped = skipped
        self._optimizer_steps = optimizer_steps
        self._pending = pending
        self.grad_norm = grad_norm
        self.lrs = lrs
        self._updated_without_pending = updated

    @property
    def skipped(self) -> bool:
        return self._skipped if self._pending is None else self._pending.resolve()

    @property
    def updated(self) -> bool:
        if self._pending is None:
            return self._updated_without_pending
        return not self._pending.resolve()

    @property
    def optimizer_steps(self) -> int:
        return self._optimizer_steps - int(self._pending is not None and self._pending.resolve())

    def __repr__(self) -> str:
        return (
            f"StepResult(updated={self.updated}, skipped={self.skipped}, "
            f"grad_norm={self.grad_norm}, lrs={self.lrs}, optimizer_steps={self.optimizer_steps})"
        )
