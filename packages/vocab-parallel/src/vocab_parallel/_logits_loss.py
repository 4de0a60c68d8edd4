"""Autograd function for sum_t c_t * log p(label_t) on logits given up to their gradient.

# B slabs, R rows per slab, N = B * R tokens, V vocabulary

``cross_entropy(..., in_place=True)`` with a "sum" or "mean" reduction knows each token's
coefficient c_t (-1, or -1 / the number of trained tokens) before backward, so one Triton
kernel per row forms everything in forward: the softmax normalizer (one read of the row), the
label's log-prob, and the gradient c_t * (onehot - p) written over the row (a second read,
soon after the first, and one write). Backward only scales the stored gradient by the upstream
gradient, on the device, and leaves it untouched when that is exactly 1. The out-of-place
form instead reads the logits once in forward and once more in backward, where nothing of them
is left in the L2 cache.

Only for the whole vocabulary on one rank (no vocabulary group: the normalizer would need the
other ranks' statistics before any gradient) and the Triton backend; other calls take
:class:`vocab_parallel._logits.VocabStats`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vocab_parallel._logits import Plan, locate_targets, unchecked_labels
from vocab_parallel._math import scale_by_upstream_


class LogitsLossInPlace(torch.autograd.Function):
    """(loss, log_p) from logits [B, R, V], labels [N] and coefficients [N] or a 0-dim tensor.

    loss = sum_t c_t * log p(label_t) (fp32 scalar, differentiable w.r.t. the logits); log_p
    [N] fp32 (0 where ignored) is not differentiable. After forward the logits hold the
    gradient of the loss (their version counter is bumped, so a saved use of them elsewhere in
    the graph fails autograd's check instead of reading it).
    """

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, labels: Tensor, coefficients: Tensor, plan: Plan
    ) -> tuple[Tensor, Tensor]:
        from vocab_parallel import _triton

        if plan.validate:  # no group: checked here, before the kernel
            targets = locate_targets(labels, plan=plan, local_vocab=logits.shape[-1])
            unchecked_labels(targets, labels, plan=plan)
        # The kernel reads the labels and the coefficient itself: no per-token tensors are
        # prepared first (a few small launches fewer ahead of the one that matters).
        log_p = _triton.loss_grad_(
            logits,
            inv_temperature=plan.inv_temperature,
            labels=labels,
            ignore_index=plan.ignore_index,
            coefficients=coefficients.float(),
        )
        torch.autograd.graph.increment_version(logits)
        # Where c_t is infinite (a "mean" over no tokens) the loss is nan, as in PyTorch.
        loss = (coefficients.float() * log_p).sum()
        ctx.grad = logits
        ctx.mark_non_differentiable(log_p)
        return loss, log_p

    @staticmethod
    def backward(
        ctx: Any, grad_loss: Tensor | None, _grad_log_p: Tensor | None
    ) -> tuple[Tensor | None, None, None, None]:
        grad = ctx.grad
        if grad is None:
            raise RuntimeError(
                "backward ran twice through an in_place=True cross_entropy: its gradient was "
                "formed in forward over the logits and handed over by the first backward; call "
                "the loss again, or pass in_place=False to use retain_graph=True"
            )
        ctx.grad = None
        if grad_loss is None:
            return None, None, None, None
        scale_by_upstream_(grad, grad_loss, backend="triton")
        return grad, None, None, None
