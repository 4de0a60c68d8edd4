"""The trained positions of a micro-batch, selected without a host synchronisation.

# B batch, S (local) sequence, T positions (B*S), K trained positions, H hidden

The fused loss's output projection costs three [T, V] matmuls, but only the K positions with a
label (labels != -100) contribute: prompts, padding and image tokens (30-60% of SFT positions,
~75% of a VLM batch) give zero loss and zero gradients. Selecting the trained rows first makes
the head's work proportional to K.

A selection needs K on the host (it is a shape), and ``mask.nonzero()`` or boolean indexing would
read it by synchronising with the GPU mid-step. :class:`TrainedRows` instead counts on the
device as soon as the labels exist, before the model's forward is launched, and copies the count
asynchronously into pinned host memory behind a CUDA event. After the forward the host waits on
that event: the GPU passed it long before (it was queued ahead of the whole forward), so the
wait costs nothing, and ``torch.nonzero_static`` with that size (no sync) gives the indices.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TrainedRows"]


class TrainedRows:
    """The trained positions of one micro-batch's labels; construct it before the forward.

    On CUDA the count reaches the host through an asynchronous copy to pinned memory (an event
    marks its arrival), so neither the construction nor :meth:`count` synchronises the stream.
    On the CPU the count is read directly (there is no device to wait for). Other devices read
    it directly too, which synchronises them.

    Args:
        labels: [B, S] (any shape) integer labels, already shifted; ``ignore_index`` marks
            positions without a target.
        ignore_index: the label value of untrained positions.
    """

    __slots__ = ("_count", "_labels", "_mask", "_ready")

    def __init__(self, labels: Tensor, *, ignore_index: int = -100) -> None:
        self._labels = labels.reshape(-1)  # [T]
        self._mask = self._labels != ignore_index  # [T] bool
        count = self._mask.sum()
        self._ready: torch.cuda.Event | None = None
        if count.is_cuda:
            host = torch.empty((), dtype=count.dtype, pin_memory=True)
            host.copy_(count, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()  # on the current stream, behind the copy
            count = host
        self._count = count  # a host tensor: reading it never touches the device

    @property
    def positions(self) -> int:
        """T: the number of positions (trained or not)."""
        return self._labels.numel()

    def count(self) -> int:
        """K: the number of trained positions (waits for the copy on CUDA; no stream sync)."""
        if self._ready is not None:
            self._ready.synchronize()  # host waits for the event only, not for the stream
        return int(self._count)

    def select(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of ``hidden`` at the trained positions, and their labels, in order.

        Args:
            hidden: [B, S, H] (leading dims as the labels'), e.g. the final hidden states.

        Returns:
            ([K, H] rows of ``hidden``, [K] labels); the rows' gradient flows back into
            ``hidden`` at those positions (zero elsewhere).

        Raises:
            ValueError: ``hidden``'s leading dims do not hold as many positions as the labels.
        """
        flat = hidden.reshape(-1, hidden.shape[-1])  # [T, H]
        if flat.shape[0] != self.positions:
            raise ValueError(
                f"hidden {tuple(hidden.shape)} has {flat.shape[0]} positions but the labels have "
                f"{self.positions}; pass the hidden states of the same (local) batch as the labels"
            )
        # nonzero_static takes K from the host: no device-to-host read of the size.
        index = torch.nonzero_static(self._mask, size=self.count()).squeeze(1)  # [K]
        return flat.index_select(0, index), self._labels.index_select(0, index)
