"""Loss normalisation under context parallelism.

The count of label tokens is taken on the batch *before* sharding (every CP rank holds the same
global batch) and reduced over data-parallel ranks only. Reducing it over CP ranks as well would
count every token ``cp`` times.

Gradient contract:

- Each CP rank computes ``local_loss = sum(per_token_loss[local tokens]) / global_count``. The sum
  of ``local_loss`` over the CP ranks is the global token-mean loss, so **summing** parameter
  gradients over CP ranks gives exactly the no-CP gradient. Data-parallel wrappers that
  **average** over a flattened ``dp_cp`` group divide by ``dp*cp``: scale the loss by the size of
  that group before backward (``loss * dp_cp_size``) to undo it.
- A loss computed on a tensor returned by ``gather_token_tensor`` is replicated: if every CP rank
  computes the same loss on the gathered tensor and calls backward, each token's gradient arrives
  at its owner ``cp`` times (the gather's backward sums over ranks). Divide such a loss by ``cp``,
  or compute it on rank 0's copy only with the others contributing zero.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["count_label_tokens", "global_label_tokens"]


def count_label_tokens(labels: Tensor, *, ignore_index: int = -100) -> int:
    """Number of positions of ``labels`` ([B, S] or [T]) that are not ``ignore_index``."""
    return int((labels != ignore_index).sum())


def global_label_tokens(
    local_count: int | Tensor,
    *,
    dp_group: Any = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Sum a pre-shard label count over data-parallel ranks (never over CP ranks).

    Args:
        local_count: this DP rank's count of label tokens before CP sharding.
        dp_group: the data-parallel process group; None means a single DP replica (no reduction).
        device: where the collective runs (cuda for NCCL groups); defaults to CPU.

    Returns:
        [] int64 tensor, identical on every rank of ``dp_group``.
    """
    count = torch.as_tensor(local_count, dtype=torch.int64, device=device).clone()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(count, group=dp_group)
    return count
