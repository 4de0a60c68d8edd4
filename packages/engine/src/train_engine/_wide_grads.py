"""A window's bf16/fp16 gradients summed in fp32 for a model without a data-parallel wrapper.

autograd accumulates a parameter's gradient across backwards in the parameter's own dtype: with
bf16 parameters every micro-batch's gradient is added into a bf16 sum, and each addition rounds
to 8 bits of mantissa, so the error grows with the window's length and small contributions
vanish next to large ones. FSDP2 (``reduce_dtype=float32``) and Megatron (``main_grad``) sum in
fp32 instead. :class:`WideGradSums` does that for an unwrapped model: after each backward the
Engine folds the narrow gradients into fp32 sums and clears them; at the window's boundary the
sums are rounded once to the parameters' dtype and become ``param.grad`` again, so the norm,
clipping and the optimizer see the window's gradient with a single rounding, whatever the
window's length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["WideGradSums"]


class WideGradSums:
    """fp32 (or ``dtype``) running sums of the narrow parameters' gradients of one window.

    A parameter is narrow when it is floating point with fewer bytes than ``dtype``. Its sum
    buffer is allocated at its first gradient and kept for later windows (``dtype``'s bytes
    per element: 4 for fp32, next to the parameter's 2). Parameters that are not narrow keep
    autograd's own accumulation. With no narrow parameter every method does nothing.

    Args:
        params: the trainable parameters of an unwrapped model. Pass none under DDP: the
            window's last backward reduces what autograd accumulated in ``param.grad``, so the
            earlier micro-batches' gradients must stay there.
        dtype: the summing dtype; None sums nothing (autograd's accumulation).
    """

    __slots__ = ("_filled", "_params", "_sums", "dtype")

    def __init__(self, params: Sequence[Tensor], dtype: torch.dtype | None) -> None:
        if dtype is not None and (
            not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
        ):
            raise ValueError(
                f"grad_accumulation_dtype must be a floating dtype (torch.float32), got {dtype}; "
                "pass None to accumulate in the parameters' dtype"
            )
        self.dtype = dtype
        width = 0 if dtype is None else dtype.itemsize  # None: no parameter is narrower
        self._params = [p for p in params if p.is_floating_point() and p.dtype.itemsize < width]
        self._sums: list[Tensor | None] = [None] * len(self._params)
        self._filled = [False] * len(self._params)

    @property
    def narrow_params(self) -> int:
        """How many parameters are summed here."""
        return len(self._params)

    @torch.no_grad()
    def fold(self) -> None:
        """Add each narrow parameter's gradient into its sum and clear ``param.grad``.

        Call after every backward of a window of several micro-batches. A parameter without a
        gradient this micro-batch (unused by its forward) keeps its sum as it is.
        """
        for i, param in enumerate(self._params):
            grad = param.grad
            if grad is None:
                continue
            total = self._sums[i]
            if self._filled[i]:
                assert total is not None  # filled implies allocated
                total.add_(grad)
            elif total is None or total.shape != grad.shape or total.device != grad.device:
                self._sums[i] = grad.to(self.dtype, copy=True)
            else:
                total.copy_(grad)
            self._filled[i] = True
            param.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """Set each summed parameter's ``grad`` to its window sum, rounded once to its dtype.

        Call at the window's boundary, before the norm. A gradient autograd left in
        ``param.grad`` since the last :meth:`fold` is added first.
        """
        for i, param in enumerate(self._params):
            if not self._filled[i]:
                continue
            total = self._sums[i]
            assert total is not None  # filled implies allocated
            if param.grad is not None:
                total.add_(param.grad)
            param.grad = total.to(param.dtype)
            self._filled[i] = False

    def clear(self) -> None:
        """Discard the window's sums (the buffers stay allocated for the next window)."""
        self._filled = [False] * len(self._params)
