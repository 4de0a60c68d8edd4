"""The dispatcher protocol, and the single-process dispatcher used without expert parallelism.

# T tokens, H hidden, K top-k, E experts, N routed (token, expert) pairs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from moe_dispatch.routing import check_routing_shapes, sort_by_expert, validate_topk_ids


@runtime_checkable
class Dispatcher(Protocol):
    """Sends tokens to the ranks that own their experts and brings the results back.

    Experts are owned contiguously: rank r of W owns global experts ``[r*E/W, (r+1)*E/W)``.
    Both directions are autograd-correct, including the gradient of ``topk_weights``.

    A distributed dispatcher may also offer ``abort_dispatch(device)``: enter its first
    collective flagged as failed, so that peers raise instead of waiting when this rank cannot
    dispatch (``ExpertParallelMoE`` calls it when its router raises).

    Attributes:
        num_experts: E, the global expert count.
        num_local_experts: E / W, experts owned by this rank.
        local_expert_start: global id of this rank's first expert.
    """

    num_experts: int
    num_local_experts: int
    local_expert_start: int

    def dispatch(
        self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> tuple[Tensor, Tensor, Any]:
        """Send each (token, expert) pair to the expert's owner.

        Args:
            hidden: [T, H]; T may differ between ranks and may be 0.
            topk_ids: [T, K] global expert ids; -1 routes a slot nowhere.
            topk_weights: [T, K] routing weights, used by ``combine``.

        Returns:
            expert_input: [T', H] rows for this rank's experts, grouped by local expert.
            tokens_per_local_expert: [E_local] int64 row counts of those groups.
            handle: opaque state for ``combine``.
        """
        ...

    def combine(self, expert_output: Tensor, handle: Any) -> Tensor:
        """Bring expert outputs back and sum them with the routing weights.

        Args:
            expert_output: [T', H], rows in ``expert_input``'s order.
            handle: what ``dispatch`` returned.

        Returns:
            [T, H] in expert_output's dtype: sum over k of topk_weights[t, k] * output of the
            (t, k) pair; rows with every slot -1 are zero.
        """
        ...


@dataclass(slots=True)
class LocalHandle:
    """State kept between ``LocalDispatcher.dispatch`` and ``combine``."""

    slots: Tensor
    tokens: Tensor
    topk_weights: Tensor
    num_tokens: int


def weighted_scatter_sum(
    returned: Tensor, tokens: Tensor, slots: Tensor, topk_weights: Tensor, num_tokens: int
) -> Tensor:
    """Sum routed rows back into their tokens, weighted by the routing weights.

    Plain autograd on local tensors, so ``topk_weights`` gets its gradient here. Accumulates in
    at least float32 and returns ``returned``'s dtype.

    Args:
        returned: [N, H] one row per routed pair, in ``slots`` order.
        tokens: [N] int64 token row of each pair.
        slots: [N] int64 flat index of each pair into ``topk_weights.reshape(-1)``.
        topk_weights: [T, K].
        num_tokens: T.

    Returns:
        [T, H].
    """
    acc_dtype = torch.promote_types(returned.dtype, torch.float32)
    weights = topk_weights.reshape(-1).index_select(0, slots).to(acc_dtype)
    contrib = returned.to(acc_dtype) * weights.unsqueeze(1)
    out = torch.zeros(
        num_tokens, returned.shape[1], dtype=acc_dtype, device=returned.device
    ).index_add(0, tokens, contrib)
    return out.to(returned.dtype)


class LocalDispatcher:
    """Dispatcher for one process that owns every expert (no communication).

    Args:
        num_experts: E.
    """

    def __init__(self, num_experts: int) -> None:
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.local_expert_start = 0

    def dispatch(
        self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> tuple[Tensor, Tensor, LocalHandle]:
        """See :meth:`Dispatcher.dispatch`."""
        check_routing_shapes(hidden, topk_ids, topk_weights)
        validate_topk_ids(topk_ids, self.num_experts)
        slots, counts = sort_by_expert(topk_ids, self.num_experts)
        tokens = torch.div(slots, topk_ids.shape[1], rounding_mode="floor")
        expert_input = hidden.index_select(0, tokens)
        handle = LocalHandle(
            slots=slots, tokens=tokens, topk_weights=topk_weights, num_tokens=hidden.shape[0]
        )
        return expert_input, counts, handle

    def combine(self, expert_output: Tensor, handle: LocalHandle) -> Tensor:
        """See :meth:`Dispatcher.combine`."""
        return weighted_scatter_sum(
            expert_output, handle.tokens, handle.slots, handle.topk_weights, handle.num_tokens
        )
