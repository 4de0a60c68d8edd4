"""Expert-parallel dispatch over ``torch.distributed.all_to_all_single`` with uneven splits.

Works on gloo (CPU) and NCCL (CUDA). Each ``dispatch`` exchanges the per-expert counts first
(one small all-to-all and one device-to-host sync for the split sizes), then the token rows.
The backward of each token all-to-all is the reverse all-to-all.

# T tokens, H hidden, K top-k, E experts, W expert-parallel ranks, N routed pairs sent,
# T' routed pairs received
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moe_dispatch.dispatcher import weighted_scatter_sum
from moe_dispatch.routing import (
    NO_EXPERT,
    check_routing_shapes,
    expert_range,
    group_major_to_expert_major,
    inverse_permutation,
    sort_by_expert,
    validate_topk_ids,
)


class _OwnsGroupExperts:
    """This rank's place in the expert-parallel group and its block of experts.

    Shared by the dispatchers that span a process group (all-to-all, HybridEP).
    """

    group: dist.ProcessGroup | None
    ep_size: int
    ep_rank: int
    num_experts: int
    num_local_experts: int
    local_expert_start: int

    def _own_experts(self, group: dist.ProcessGroup | None, num_experts: int) -> None:
        """Set the group, this rank's size and rank in it, and its experts (:func:`expert_range`)."""
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        start, end = expert_range(num_experts, self.ep_size, self.ep_rank)
        self.num_experts = num_experts
        self.num_local_experts = end - start
        self.local_expert_start = start


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows whose backward is the all-to-all in the other direction."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> Tensor:
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        ctx.group = group
        return _exchange(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return (
            _exchange(grad, ctx.input_splits, ctx.output_splits, ctx.group),
            None,
            None,
            None,
        )


def _exchange(
    rows: Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
) -> Tensor:
    rows = rows.contiguous()
    out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows, output_splits, input_splits, group=group)
    return out


def all_to_all_rows(
    rows: Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Differentiable uneven all-to-all along dim 0.

    Args:
        rows: [sum(input_splits), ...]; block i goes to rank i.
        output_splits: rows received from each rank.
        input_splits: rows sent to each rank.
        group: the process group (None: the default group).

    Returns:
        [sum(output_splits), ...], blocks in source-rank order.
    """
    out: Tensor = _AllToAll.apply(rows, output_splits, input_splits, group)
    return out


@dataclass(slots=True)
class AllToAllHandle:
    """State kept between ``AllToAllDispatcher.dispatch`` and ``combine``.

    Attributes:
        slots: [N] flat (token, k) index of each sent pair, in send order.
        tokens: [N] token row of each sent pair.
        topk_weights: [T, K] the routing weights given to dispatch.
        send_splits: pairs sent to each rank.
        recv_splits: pairs received from each rank.
        regroup: [T'] permutation from source-major to local-expert-major order.
        num_tokens: T.
    """

    slots: Tensor
    tokens: Tensor
    topk_weights: Tensor
    send_splits: list[int]
    recv_splits: list[int]
    regroup: Tensor
    num_tokens: int


class AllToAllDispatcher(_OwnsGroupExperts):
    """Dispatcher over an uneven all-to-all in the expert-parallel group.

    Example::

        dispatcher = AllToAllDispatcher(ep_group, num_experts=64)
        x, counts, handle = dispatcher.dispatch(hidden, topk_ids, topk_weights)
        y = experts(x, counts)            # rows grouped by local expert
        out = dispatcher.combine(y, handle)

    Args:
        ep_group: the expert-parallel process group (None: the default group).
        num_experts: E, divisible by the group size.
    """

    def __init__(self, ep_group: dist.ProcessGroup | None, num_experts: int) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "AllToAllDispatcher needs torch.distributed; call "
                "torch.distributed.init_process_group first, or use LocalDispatcher on one process"
            )
        self._own_experts(ep_group, num_experts)

    def dispatch(
        self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> tuple[Tensor, Tensor, AllToAllHandle]:
        """See :meth:`moe_dispatch.Dispatcher.dispatch`.

        Invalid input on any rank (bad shapes, ids outside ``[-1, E)``) raises on every rank of
        the group: the check rides on the count exchange, so no rank is left waiting.
        """
        try:
            check_routing_shapes(hidden, topk_ids, topk_weights)
        except (ValueError, TypeError):
            self.abort_dispatch(hidden.device)
            raise
        invalid = (topk_ids < NO_EXPERT) | (topk_ids >= self.num_experts)
        slots, counts = sort_by_expert(topk_ids.masked_fill(invalid, NO_EXPERT), self.num_experts)
        tokens = torch.div(slots, topk_ids.shape[1], rounding_mode="floor")
        recv_counts_2d, send_splits, recv_splits, failed = self._exchange_counts(
            counts, invalid.any()
        )
        if failed:
            if self.ep_rank in failed:
                validate_topk_ids(topk_ids, self.num_experts)  # raises with the bad value
            raise ValueError(
                f"expert-parallel ranks {failed} passed expert ids outside [-1, "
                f"{self.num_experts}); every rank stops so that none waits in a collective"
            )
        received = all_to_all_rows(
            hidden.index_select(0, tokens), recv_splits, send_splits, self.group
        )
        regroup = group_major_to_expert_major(recv_counts_2d, total=sum(recv_splits))
        expert_input = received.index_select(0, regroup)
        handle = AllToAllHandle(
            slots=slots,
            tokens=tokens,
            topk_weights=topk_weights,
            send_splits=send_splits,
            recv_splits=recv_splits,
            regroup=regroup,
            num_tokens=hidden.shape[0],
        )
        return expert_input, recv_counts_2d.sum(0), handle

    def abort_dispatch(self, device: torch.device) -> None:
        """Enter dispatch's first collective flagged as failed, so peers raise instead of waiting.

        Call it when this rank cannot dispatch (e.g. its router raised), then raise locally.
        """
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=device)
        self._exchange_counts(counts, torch.ones((), dtype=torch.bool, device=device))

    def _exchange_counts(
        self, counts: Tensor, local_failure: Tensor
    ) -> tuple[Tensor, list[int], list[int], list[int]]:
        """All-to-all of per-expert counts plus a failure flag; one host sync.

        Returns:
            [W, E_local] rows this rank receives (by source, by local expert), the rows it sends
            to and receives from each rank, and the ranks that flagged a failure.
        """
        per_dest = counts.view(self.ep_size, self.num_local_experts)
        flag = local_failure.to(counts.dtype).reshape(1, 1).expand(self.ep_size, 1)
        send = torch.cat([per_dest, flag], dim=1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        recv_counts = recv[:, :-1]
        host = torch.cat([per_dest.sum(1), recv_counts.sum(1), recv[:, -1]]).tolist()
        w = self.ep_size
        failed = [rank for rank, bad in enumerate(host[2 * w :]) if bad]
        return recv_counts, host[:w], host[w : 2 * w], failed

    def combine(self, expert_output: Tensor, handle: AllToAllHandle) -> Tensor:
        """See :meth:`moe_dispatch.Dispatcher.combine`."""
        if expert_output.shape[0] != handle.regroup.numel():
            raise ValueError(
                f"expert_output has {expert_output.shape[0]} rows but dispatch sent this rank "
                f"{handle.regroup.numel()}; pass one output row per expert_input row, same order"
            )
        source_major = expert_output.index_select(0, inverse_permutation(handle.regroup))
        returned = all_to_all_rows(source_major, handle.send_splits, handle.recv_splits, self.group)
        return weighted_scatter_sum(
            returned, handle.tokens, handle.slots, handle.topk_weights, handle.num_tokens
        )
