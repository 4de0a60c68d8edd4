"""The number of trained positions of a micro-batch, on the host without a synchronisation.

# B batch, S (local) sequence, T positions (B*S), K trained positions

The fused loss's output projection costs three [T, V] matmuls, but only the K positions with a
label (labels != -100) contribute: prompts, padding and image tokens (30-60% of SFT positions,
~75% of a VLM batch) give zero loss and zero gradients. vocab-parallel's fused loss leaves them
out of its matmuls (``skip_ignored``), which makes the head's work proportional to K.

Selecting them needs K on the host (it is a shape), and ``mask.nonzero()`` or boolean indexing
would read it by synchronising with the GPU mid-step. :class:`TrainedRows` instead counts on the
device as soon as the labels exist, before the model's forward is launched, and copies the count
asynchronously into pinned host memory behind a CUDA event. After the forward the host waits on
that event: the GPU passed it long before (it was queued ahead of the whole forward), so the
wait costs nothing, and the loss, given K (``trained_count``), selects the positions with
``torch.nonzero_static`` of that size (no sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TrainedRows"]


class TrainedRows:
    """How many of a micro-batch's positions are trained; construct it before the forward.

    On CUDA the count reaches the host through an asynchronous copy to pinned memory (an event
    marks its arrival), so neither the construction nor :meth:`count` synchronises the stream.
    On the CPU the count is read directly (there is no device to wait for). Other devices read
    it directly too, which synchronises them.

    Args:
        labels: [B, S] (any shape) integer labels, already shifted; ``ignore_index`` marks
            positions without a target.
        ignore_index: the label value of untrained positions.
    """

    __slots__ = ("_count", "_ready")

    def __init__(self, labels: Tensor, *, ignore_index: int = -100) -> None:
        count = (labels != ignore_index).sum()
        self._ready: torch.cuda.Event | None = None
        if count.is_cuda:
            host = torch.empty((), dtype=count.dtype, pin_memory=True)
            host.copy_(count, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()  # on the current stream, behind the copy
            count = host
        self._count = count  # a host tensor: reading it never touches the device

    def count(self) -> int:
        """K: the number of trained positions (waits for the copy on CUDA; no stream sync)."""
        if self._ready is not None:
            self._ready.synchronize()  # host waits for the event only, not for the stream
        return int(self._count)
