"""Token-mean loss over the global batch, safe when the global batch has no target.

# B batch, S sequence.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["global_trainable_tokens", "token_mean_loss"]


def global_trainable_tokens(loss_mask: Tensor, *, group: Any = None) -> int:
    """Number of trained tokens summed over the data-parallel group (an all-reduce).

    Args:
        loss_mask: [B, S] 0/1 mask of this rank's micro-batches (all of one step).
        group: the dp process group; None = no reduction (single process).
    """
    count = loss_mask.detach().to(torch.float64).sum().reshape(1)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(count, group=group)
    return int(count.item())


def token_mean_loss(per_token_loss: Tensor, loss_mask: Tensor, global_tokens: int) -> Tensor:
    """sum(loss * mask) / global_tokens; 0 (with gradient 0) when the global batch has no target.

    Every rank divides by the same global count, so summing the ranks' results (DDP gradient
    averaging times dp) gives the token mean over the global batch.

    Args:
        per_token_loss: [B, S] loss per position (e.g. cross-entropy with reduction="none").
        loss_mask: [B, S] 0/1, e.g. `SFTBatch.loss_mask`.
        global_tokens: `global_trainable_tokens(...)` of the step.

    Returns:
        A scalar with per_token_loss's dtype.
    """
    if per_token_loss.shape != loss_mask.shape:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and loss_mask "
            f"{tuple(loss_mask.shape)} must have the same [B, S] shape"
        )
    masked = (per_token_loss * loss_mask.to(per_token_loss.dtype)).sum()
    if global_tokens <= 0:
        # Reported, not divided by zero: the step still runs (every rank agrees, since the
        # count is global) and contributes no gradient.
        logger.warning("energon-sft: the global batch has no trainable token; loss set to 0")
        return masked * 0.0
    return masked / global_tokens
