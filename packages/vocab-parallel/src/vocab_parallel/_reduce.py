"""Combine per-shard statistics across the vocabulary ranks with two per-token collectives.

# N tokens

Only [N]-sized tensors cross ranks: one MAX all-reduce of the per-token maxima, then one SUM
all-reduce of the stacked per-token scalars (sum of exponentials, target logit, and, when
wanted, the entropy and uniform terms) plus one element counting invalid labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from vocab_parallel._math import rescale, safe_shift
from vocab_parallel._stats import ShardStats


@dataclass(kw_only=True, slots=True)
class GlobalStats:
    """Per-token statistics over the whole vocabulary, fp32 [N], identical on every rank.

    Attributes:
        log_normalizer: logZ = log sum_v exp(z_v).
        shift: the global max used as the reference point (0 for fully masked rows).
        log_sum_exp: log sum_v exp(z_v - shift), so logZ = shift + log_sum_exp.
        target: z_y (0 where the label is ignored).
        entropy: H, or None.
        sum_z: sum_v z_v, or None.
        invalid_labels: number of labels outside [0, V) that are not ignore_index (0 unless
            the caller counted them).
    """

    log_normalizer: Tensor
    shift: Tensor
    log_sum_exp: Tensor
    target: Tensor
    entropy: Tensor | None
    sum_z: Tensor | None
    invalid_labels: int


def reduce_stats(
    stats: ShardStats,
    *,
    target: Tensor,
    invalid_labels: Tensor | None,
    group: dist.ProcessGroup | None,
) -> GlobalStats:
    """Turn local statistics into global ones.

    Args:
        stats: this rank's statistics over its vocabulary shard, [N] each.
        target: [N] fp32 target logit if the target is in this shard, else 0.
        invalid_labels: scalar fp32 count of out-of-range labels seen here, or None (not checked).
        group: the vocabulary process group, or None for a rank that holds all of V.
    """
    global_max = stats.max
    if group is not None:
        global_max = stats.max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    local = rescale(stats, global_max)
    rows = [local.sum_exp, target]
    if local.sum_exp_z is not None:
        rows.append(local.sum_exp_z)
    if local.sum_z is not None:
        rows.append(local.sum_z)
    count = invalid_labels if invalid_labels is not None else target.new_zeros(())
    if group is not None:
        # One collective for everything that sums: [k * N + 1] floats.
        packed = torch.cat([torch.stack(rows).reshape(-1), count.reshape(1)])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        n = target.numel()
        rows = list(packed[:-1].reshape(len(rows), n).unbind(0))
        count = packed[-1]
    sum_exp, target_sum = rows[0], rows[1]
    extra = rows[2:]
    sum_exp_z = extra.pop(0) if local.sum_exp_z is not None else None
    sum_z = extra.pop(0) if local.sum_z is not None else None
    shift = safe_shift(global_max)
    log_sum_exp = torch.log(sum_exp)
    entropy = None
    if sum_exp_z is not None:
        entropy = log_sum_exp - sum_exp_z / sum_exp
    return GlobalStats(
        log_normalizer=shift + log_sum_exp,
        shift=shift,
        log_sum_exp=log_sum_exp,
        target=target_sum,
        entropy=entropy,
        sum_z=sum_z,
        invalid_labels=int(count.item()) if invalid_labels is not None else 0,
    )
