"""The update at a window's boundary: the non-finite policy, clipping, optimizer and scheduler.

The gradient norm is already computed (by ``Engine.step``). This module turns it into exactly
one of: an update, a skip, or :class:`NonFiniteGradientError`, decided identically on every
rank. A window without loss tokens (contract (b) with a global count of 0) is skipped under
every policy: its gradient is zero, and an update would still move the weights (weight decay,
momentum) and advance the schedule for a step that learned nothing. With a fused optimizer and the ``skip``/``step`` policy the clip factor and the skip flag
go into the optimizer's kernel as device tensors (see :mod:`train_engine._device_update`), so
the update needs no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from train_engine._counters import UpdateCounters
from train_engine._device_update import PendingUpdate, grad_divisor, step_on_device
from train_engine._step_result import StepResult
from train_engine._tokens import backend_device
from train_engine.grad_norm import clip_grads_with_norm_

__all__ = [
    "POLICIES",
    "NonFiniteGradientError",
    "NonFinitePolicy",
    "UpdateRule",
    "empty_window",
    "learning_rates",
    "nonfinite_flag",
    "result_without_update",
]

NonFinitePolicy = Literal["skip", "raise", "step"]
POLICIES = ("skip", "raise", "step")


class NonFiniteGradientError(FloatingPointError):
    """Raised by ``Engine.step`` on every rank when the global gradient norm is inf or NaN.

    Only with ``nonfinite="raise"``. The window's gradients are cleared; the Engine stays
    usable.
    """


def learning_rates(optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    """The learning rate of each parameter group, as Python floats."""
    return tuple(float(group["lr"]) for group in optimizer.param_groups)


def nonfinite_flag(norm: Tensor) -> Tensor:
    """0-dim float32 tensor, 1 on every rank when the norm is inf/NaN on any (no host sync)."""
    flag = (~torch.isfinite(norm)).to(torch.float32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(backend_device(None))
        # A NaN on any rank must skip (or raise) on all of them, or ranks diverge or hang.
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def empty_window(num_tokens: float | Tensor | None) -> bool | Tensor:
    """Whether a window had no loss tokens, from its count (``AccumulationWindow.num_tokens``).

    Returns:
        A bool for a host count (False under contract (a), which has none), or a 0-dim
        float32 flag on the count's device (1: empty) for a count on an accelerator, read
        without a host sync. The count is global (summed over the data-parallel ranks), so
        every rank decides the same.
    """
    if isinstance(num_tokens, Tensor):
        return (num_tokens.detach().reshape(()) == 0).to(torch.float32)
    return num_tokens == 0


def result_without_update(
    optimizer: torch.optim.Optimizer,
    counters: UpdateCounters,
    *,
    norm: Tensor | None = None,
    no_loss_tokens: bool = False,
) -> StepResult:
    """The StepResult of a call that made no update.

    Args:
        optimizer: the optimizer (its current learning rates are reported).
        counters: the Engine's counters.
        norm: the window's norm when it was skipped on the host; None off the boundary, where
            the run of skips is the last window's and waits on that window's flag, if any.
        no_loss_tokens: the window was skipped for having no loss tokens.
    """
    return StepResult(
        updated=False,
        skipped=norm is not None,
        no_loss_tokens=no_loss_tokens,
        grad_norm=norm,
        lrs=learning_rates(optimizer),
        optimizer_steps=counters.optimizer_steps,
        consecutive_skipped=counters.consecutive_skipped,
        consecutive_pending=counters.pending,
    )


@dataclass(kw_only=True, slots=True, frozen=True)
class UpdateRule:
    """How one window's gradients become (at most) one optimizer and scheduler step.

    Attributes:
        optimizer: the optimizer over the model's parameters.
        lr_scheduler: stepped once after every update; None for none.
        max_grad_norm: clip the global norm to this; None disables clipping.
        nonfinite: the non-finite policy ("skip", "raise" or "step").
    """

    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    max_grad_norm: float | None
    nonfinite: NonFinitePolicy

    def apply(
        self,
        norm: Tensor,
        params: list[torch.nn.Parameter],
        *,
        empty: bool | Tensor,
        on_device: bool,
        counters: UpdateCounters,
        end_window: Callable[[], None],
    ) -> StepResult:
        """Update (or skip) on the window's norm and token count, count it and end the window.

        Args:
            norm: the window's global gradient norm, a 0-dim float64 device tensor.
            params: the trainable parameters (clipped in place on the host path).
            empty: :func:`empty_window` of the window's count: skip, whatever the policy. A
                device flag is read on the host path (which already reads the non-finite
                flag, except under "step" with a non-fused optimizer: one host sync there).
            on_device: decide skip and clip inside the fused optimizer's kernel (the caller
                checked that the optimizer supports it and that the flag lives with the
                parameters); ignored under the "raise" policy.
            counters: the Engine's counters, already settled.
            end_window: clears the gradients and starts the next window.

        Raises:
            NonFiniteGradientError: ``nonfinite="raise"`` and the norm is not finite.
        """
        if on_device and self.nonfinite != "raise":
            return self._update_on_device(norm, empty, counters=counters, end_window=end_window)
        if isinstance(empty, Tensor):
            empty = bool(empty.item())
        if self.nonfinite != "step" and bool(nonfinite_flag(norm).item()):
            window = counters.windows + 1
            end_window()
            counters.count_skip(window, decided="on the host", log=self.nonfinite != "raise")
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"non-finite global gradient norm at step {window} (accumulation window "
                    f"{window}, after {counters.optimizer_steps} optimizer updates; on at least "
                    "one rank); the window's gradients were cleared and no update was made. Use "
                    "nonfinite='skip' to continue past such windows"
                )
            return result_without_update(self.optimizer, counters, norm=norm)
        if empty:
            window = counters.windows + 1
            end_window()
            counters.count_skip(window, decided="on the host", empty=True)
            return result_without_update(self.optimizer, counters, norm=norm, no_loss_tokens=True)
        if self.max_grad_norm is not None:
            clip_grads_with_norm_(params, self.max_grad_norm, norm)
        lrs = learning_rates(self.optimizer)
        self.optimizer.step()
        return self._finish(norm, lrs, None, counters=counters, end_window=end_window)

    def _update_on_device(
        self,
        norm: Tensor,
        empty: bool | Tensor,
        *,
        counters: UpdateCounters,
        end_window: Callable[[], None],
    ) -> StepResult:
        """Clip, skip and update inside a fused optimizer's kernel: no host synchronisation."""
        found_inf = nonfinite_flag(norm) if self.nonfinite == "skip" else None
        empty_flag = None
        if isinstance(empty, Tensor) or empty:
            # One flag for the kernel: skip when non-finite (policy "skip") or empty.
            device = norm.device if found_inf is None else found_inf.device
            empty_flag = torch.as_tensor(empty, dtype=torch.float32).to(device)
            found_inf = empty_flag if found_inf is None else torch.maximum(found_inf, empty_flag)
        divisor = None
        if self.max_grad_norm is not None:
            divisor = grad_divisor(norm, self.max_grad_norm)
        lrs = learning_rates(self.optimizer)
        step_on_device(self.optimizer, divisor=divisor, found_inf=found_inf)
        pending = None
        if found_inf is not None:
            # Snapshots the scheduler before _finish steps it.
            pending = PendingUpdate(found_inf, self.optimizer, self.lr_scheduler, empty=empty_flag)
        return self._finish(norm, lrs, pending, counters=counters, end_window=end_window)

    def _finish(
        self,
        norm: Tensor,
        lrs: tuple[float, ...],
        pending: PendingUpdate | None,
        *,
        counters: UpdateCounters,
        end_window: Callable[[], None],
    ) -> StepResult:
        """Step the scheduler, count the update and end the window (the optimizer has run)."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        # The run of skips before this update: a pending flag decides whether it grows.
        before = counters.consecutive_skipped
        counters.count_update(pending)
        end_window()
        return StepResult(
            updated=True,
            skipped=False,
            grad_norm=norm,
            lrs=lrs,
            optimizer_steps=counters.optimizer_steps,
            consecutive_skipped=counters.consecutive_skipped if pending is None else before,
            pending=pending,
            consecutive_pending=pending,
        )
