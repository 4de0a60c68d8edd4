"""The update without a host synchronisation, for optimizers that can skip on the device.

Fused torch optimizers (``fused=True`` Adam, AdamW, SGD, Adagrad) accept two device tensors
through the interface ``GradScaler`` uses: ``grad_scale`` divides every gradient inside the
update kernel, and ``found_inf`` turns the whole update (step counters included) into a no-op.
The Engine uses them for clipping (no separate pass over the gradients) and for the skips:
a non-finite norm, or a window without loss tokens whose count is on the device (no host read
of the norm or the count before the update).

Only the learning-rate scheduler is host-side. It is stepped optimistically; the skip flag is
copied to the host asynchronously and read at the next boundary or when anything asks (by
then the GPU is long past it, so the read does not stall). A skipped update then restores the
scheduler's state and the parameter groups' hyperparameters from before the step: nothing
read them in between, since only the optimizer's update does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from train_engine._tokens import backend_device
from train_engine.grad_norm import CLIP_EPS


def supports_device_update(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``grad_scale`` / ``found_inf`` device tensors."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    # A GradScaler driving the same optimizer owns these attributes: do not fight over them.
    return getattr(optimizer, "grad_scale", None) is None and (
        getattr(optimizer, "found_inf", None) is None
    )


def flag_on_param_device(param_device_types: frozenset[str]) -> bool:
    """Whether the agreed non-finite flag lives where the parameters do.

    Offloaded parameters (CPU) under NCCL would make the CPU kernel read a flag still in
    flight from the GPU, so their update takes the host path.
    """
    if len(param_device_types) != 1:
        return False
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return backend_device(None).type in param_device_types
    return True


def grad_divisor(norm: Tensor, max_norm: float) -> Tensor:
    """``1 / min(1, max_norm / (norm + eps))``: dividing by it is clip_grad_norm_'s scaling."""
    return torch.clamp((norm + CLIP_EPS) / max_norm, min=1.0).to(torch.float32)


def step_on_device(
    optimizer: torch.optim.Optimizer, *, divisor: Tensor | None, found_inf: Tensor | None
) -> None:
    """One ``optimizer.step()`` with gradient division and skip decided on the device."""
    optimizer.grad_scale = divisor  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = None  # type: ignore[attr-defined]


class PendingUpdate:
    """An update whose skip flag is still on its way to the host.

    Args:
        found_inf: 0-dim float32 device tensor, 1 when the update was skipped on the device.
        optimizer: the optimizer, already stepped (its hyperparameters are restored on a skip).
        lr_scheduler: the scheduler, not yet stepped for this update (restored on a skip).
        empty: 0-dim float32 device tensor, 1 when the window had no loss tokens (one of the
            reasons ``found_inf`` may hold); None when the count was not on the device.
    """

    __slots__ = (
        "_detached",
        "_empty_flag",
        "_event",
        "_flag",
        "_group_settings",
        "_lr_scheduler",
        "_optimizer",
        "_scheduler_state",
        "empty",
        "skipped",
    )

    def __init__(
        self,
        found_inf: Tensor,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        *,
        empty: Tensor | None = None,
    ) -> None:
        self._flag = found_inf.to("cpu", non_blocking=True)
        self._empty_flag = None if empty is None else empty.to("cpu", non_blocking=True)
        self._event = None
        if found_inf.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        # Schedulers write tensor learning rates in place: keep copies, not the tensors.
        self._group_settings = [
            {
                k: v.clone() if isinstance(v, Tensor) else v
                for k, v in group.items()
                if k != "params"
            }
            for group in optimizer.param_groups
        ]
        self._scheduler_state = None if lr_scheduler is None else lr_scheduler.state_dict()
        self._optimizer = optimizer
        self._lr_scheduler = lr_scheduler
        self._detached = False
        self.skipped: bool | None = None
        self.empty = False  # set by resolve(): the skip was for a window without loss tokens

    def detach(self) -> None:
        """Forget the snapshot: the optimizer and scheduler were replaced (a loaded state).

        A later read of the flag must not restore the snapshot over them.
        """
        self._detached = True

    def resolve(self) -> bool:
        """Read the flag (waits only for the flag's copy); on a skip, undo the scheduler step."""
        if self.skipped is not None:
            return self.skipped
        if self._event is not None:
            self._event.synchronize()
        self.skipped = bool(self._flag.item())
        self.empty = self._empty_flag is not None and bool(self._empty_flag.item())
        if self.skipped and not self._detached:
            if self._lr_scheduler is not None:
                self._lr_scheduler.load_state_dict(self._scheduler_state)
            for group, settings in zip(
                self._optimizer.param_groups, self._group_settings, strict=True
            ):
                for key, value in settings.items():
                    if isinstance(group.get(key), Tensor):
                        group[key].copy_(value)
                    else:
                        group[key] = value
        return self.skipped
