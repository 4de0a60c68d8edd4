"""A running average of the data-parallel mean loss, kept on device until read."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LossWindow"]


class LossWindow:
    """Average of the last ``steps`` losses, each averaged over the data-parallel ranks.

    :meth:`update` only writes into a device ring buffer (no host synchronisation, no
    collective); :meth:`average` and :meth:`last` do one all-reduce over ``group`` and one host
    read. The DP mean of window means equals the window mean of DP means, so ranks only need
    to agree when the value is read. Every rank of ``group`` must read together.

    Args:
        steps: window length (> 0).
        group: data-parallel process group; None for the default group (or no reduction when
            torch.distributed is not initialised).
    """

    def __init__(self, steps: int = 50, *, group: dist.ProcessGroup | None = None) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int > 0, got {steps!r}")
        self.steps = steps
        self.group = group
        self._buffer: Tensor | None = None
        self._count = 0  # losses seen so far (host counter: no sync needed)

    def __len__(self) -> int:
        return min(self._count, self.steps)

    def update(self, loss: Tensor | float) -> None:
        """Record one step's local loss (a 0-dim tensor or number); detached, no sync."""
        value = loss.detach() if isinstance(loss, Tensor) else torch.tensor(float(loss))
        if value.numel() != 1:
            raise ValueError(f"loss must hold one value, got shape {tuple(value.shape)}")
        if self._buffer is None:
            self._buffer = torch.zeros(self.steps, dtype=torch.float64, device=value.device)
        self._buffer[self._count % self.steps].copy_(value.reshape(()))
        self._count += 1

    def _dp_mean(self, value: Tensor) -> float:
        if dist.is_available() and dist.is_initialized():
            size = dist.get_world_size(self.group)
            if size > 1:
                if "nccl" in str(dist.get_backend(self.group)) and value.device.type == "cpu":
                    value = value.cuda()
                dist.all_reduce(value, group=self.group)
                value = value / size
        return float(value.item())

    def average(self) -> float | None:
        """Mean over the window of the DP-mean loss; None before the first update (collective)."""
        if self._buffer is None:
            return None
        n = len(self)
        return self._dp_mean(self._buffer[:n].sum() / n)

    def last(self) -> float | None:
        """The latest DP-mean loss; None before the first update (collective)."""
        if self._buffer is None:
            return None
        return self._dp_mean(self._buffer[(self._count - 1) % self.steps].clone())

    def reset(self) -> None:
        """Forget all recorded losses."""
        self._buffer = None
        self._count = 0
