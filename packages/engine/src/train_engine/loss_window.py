"""A running average of the global training loss, kept on device until read.

The window follows the Engine's two loss contracts (see :meth:`Engine.backward`), so the caller
passes what it passes to the Engine and never rescales by the parallel layout itself: (a) a
rank's mean loss, averaged over the ranks; (b) a rank's part of the sum of token losses with
the global token count, giving the exact global token mean however the tokens are split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LossWindow"]

_STATE_VERSION = 1


class LossWindow:
    """Average of the last ``steps`` global losses (one per optimizer step).

    :meth:`update` only writes into a device ring buffer (no host synchronisation, no
    collective); :meth:`average` and :meth:`last` do one all-reduce over ``group`` and one host
    read. The group mean of window means equals the window mean of group means, so ranks only
    need to agree when the value is read. Every rank of ``group`` must read together.

    Args:
        steps: window length (> 0).
        group: the ranks whose losses make up the global loss: the data-parallel ranks, and
            the context-parallel ranks too when they hold parts of a replica's token sum (the
            Engine's gradient mesh); not tensor-parallel ranks, which hold copies. None for
            the default group (or no reduction when torch.distributed is not initialised).
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

    def update(self, loss: Tensor | float, num_tokens: Tensor | float | None = None) -> None:
        """Record one step's loss on this rank; detached, no sync.

        Args:
            loss: a 0-dim tensor or number. Contract (a), ``num_tokens=None``: this rank's
                mean loss of the step; the window reads the mean over ``group``. Contract (b):
                this rank's part of the step's sum of token losses (all micro-batches); the
                window reads the sum over ``group`` divided by ``num_tokens``, the global
                token mean.
            num_tokens: contract (b) only: the step's loss tokens over all ranks of the
                global batch (``Engine.global_num_tokens``), the same on every rank; a 0-dim
                tensor (kept on its device: no sync) or a number.

        Raises:
            ValueError: ``loss`` holds more than one value.
        """
        value = loss.detach() if isinstance(loss, Tensor) else torch.tensor(float(loss))
        if value.numel() != 1:
            raise ValueError(f"loss must hold one value, got shape {tuple(value.shape)}")
        if num_tokens is not None:
            # Stored as this rank's share times the group size, so that the group mean taken
            # at read time (the same reduction as contract (a)) is the sum over the group / N.
            tokens = torch.as_tensor(num_tokens).to(value.device, torch.float64)
            value = value.to(torch.float64) * self._group_size() / tokens
        if self._buffer is None:
            self._buffer = torch.zeros(self.steps, dtype=torch.float64, device=value.device)
        elif self._buffer.device != value.device:
            # Once, after load_state_dict (which restores on the CPU): follow the losses'
            # device so that later updates stay device-side copies.
            self._buffer = self._buffer.to(value.device)
        self._buffer[self._count % self.steps].copy_(value.reshape(()))
        self._count += 1

    def _group_size(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.group)
        return 1

    def _group_mean(self, value: Tensor) -> float:
        if dist.is_available() and dist.is_initialized():
            size = dist.get_world_size(self.group)
            if size > 1:
                if "nccl" in str(dist.get_backend(self.group)) and value.device.type == "cpu":
                    value = value.cuda()
                dist.all_reduce(value, group=self.group)
                value = value / size
        return float(value.item())

    def average(self) -> float | None:
        """Mean over the window of the global loss; None before the first update (collective)."""
        if self._buffer is None:
            return None
        n = len(self)
        return self._group_mean(self._buffer[:n].sum() / n)

    def last(self) -> float | None:
        """The latest global loss; None before the first update (collective)."""
        if self._buffer is None:
            return None
        return self._group_mean(self._buffer[(self._count - 1) % self.steps].clone())

    def state_dict(self) -> dict[str, Any]:
        """This rank's window as plain Python numbers (one host read; call at checkpoint time).

        The values are the local, not yet group-averaged, losses, so the state is per rank: save
        it in each rank's extra state. It holds only ints, floats and a list of floats, so it
        pickles and loads with ``torch.load(weights_only=True)``.

        Returns:
            ``{"version": 1, "steps": int, "count": int, "values": list[float]}``: ``values``
            is the ring buffer as stored (``len(self)`` entries, slot ``count % steps`` next
            to be overwritten), so a restored window sums in the same order and
            :meth:`average` and :meth:`last` continue bit for bit.
        """
        values = [] if self._buffer is None else self._buffer[: len(self)].tolist()
        return {
            "version": _STATE_VERSION,
            "steps": self.steps,
            "count": self._count,
            "values": [float(v) for v in values],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a window saved by :meth:`state_dict`, replacing the current contents.

        With the same ``steps`` the window continues exactly. With another ``steps`` the
        latest ``min(len, steps)`` losses are kept in order (the average is then the same
        losses' mean, summed in another order).

        Raises:
            ValueError: ``state`` is not a LossWindow state of a supported version.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a LossWindow state of version {_STATE_VERSION} (got {found!r}); "
                "pass what LossWindow.state_dict() returned"
            )
        steps, count, values = int(state["steps"]), int(state["count"]), list(state["values"])
        if steps < 1 or count < 0 or len(values) != min(count, steps):
            raise ValueError(
                f"inconsistent LossWindow state: steps={steps}, count={count}, "
                f"{len(values)} values (expected min(count, steps)={min(count, steps)})"
            )
        if not values:
            self.reset()
            return
        if steps == self.steps:
            ring, new_count = values, count
        else:
            # Chronological order: the ring starts at the oldest slot once it has wrapped.
            start = count % steps if count >= steps else 0
            ordered = values[start:] + values[:start]
            ring = ordered[-self.steps :]
            new_count = len(ring)
        buffer = torch.zeros(self.steps, dtype=torch.float64)
        buffer[: len(ring)] = torch.tensor(ring, dtype=torch.float64)
        self._buffer = buffer
        self._count = new_count

    def reset(self) -> None:
        """Forget all recorded losses."""
        self._buffer = None
        self._count = 0
