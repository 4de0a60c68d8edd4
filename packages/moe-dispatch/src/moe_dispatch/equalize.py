"""Uniform, aligned per-rank token counts for kernels that need them (HybridEP).

HybridEP aborts or hangs unless every rank of the expert-parallel group passes the same token
count, and its all-gather asserts a multiple of 16 bytes at 4 bytes per token, i.e. a count that
is a multiple of 4. Padding rows route nowhere (ids -1, weights 0): they reach no expert, count in
no load statistic or auxiliary loss, carry no gradient, and ``EqualizingDispatcher.combine``
slices them off.

# T tokens (this rank), S padded tokens (every rank), H hidden, K top-k
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moe_dispatch.dispatcher import Dispatcher
from moe_dispatch.routing import NO_EXPERT, check_routing_shapes

#: HybridEP's requirement: per-rank token counts that are multiples of 4 (16 bytes at 4 B each).
HYBRID_EP_ALIGNMENT = 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_token_count(
    num_tokens: int,
    *,
    group: dist.ProcessGroup | None = None,
    alignment: int = HYBRID_EP_ALIGNMENT,
    device: torch.device | None = None,
) -> int:
    """The group-wide padded count S: max over ranks of T, rounded up to ``alignment``.

    One MAX all-reduce of a scalar. Call it once per step (every MoE layer of a step sees the
    same T) and pass the result as ``padded_size``, rather than once per layer.

    Args:
        num_tokens: T on this rank.
        group: the expert-parallel group; None with torch.distributed uninitialised means one
            process.
        alignment: round up to this multiple (>= 1).
        device: where the scalar lives for the all-reduce (CUDA for NCCL groups; default CPU).

    Returns:
        S, identical on every rank; at least ``alignment`` so no rank passes an empty batch.

    Raises:
        ValueError: a peer could not dispatch (it entered this exchange through a dispatcher's
            ``abort_dispatch``): every rank stops instead of waiting in the next collective.
    """
    padded, failed = _exchange_padded_count(
        num_tokens, failed=False, group=group, alignment=alignment, device=device
    )
    if failed:
        raise ValueError(
            f"expert-parallel ranks {failed} could not dispatch (see their errors); every rank "
            "stops so that none waits in a collective"
        )
    return padded


def _exchange_padded_count(
    num_tokens: int,
    *,
    failed: bool,
    group: dist.ProcessGroup | None,
    alignment: int,
    device: torch.device | None,
) -> tuple[int, list[int]]:
    """S and the group ranks that flagged a failure, from one MAX all-reduce.

    The reduced vector is ``[T, flag of group rank 0, ..., flag of group rank W-1]``: each
    rank sets only its own flag, so the MAX names every failed rank.
    """
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    longest, failed_ranks = num_tokens, [0] if failed else []
    if dist.is_initialized():
        value = torch.zeros(1 + dist.get_world_size(group), dtype=torch.int64, device=device)
        value[0] = num_tokens
        value[1 + dist.get_rank(group)] = int(failed)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        host = value.tolist()
        longest = host[0]
        failed_ranks = [rank for rank, bad in enumerate(host[1:]) if bad]
    return max(_round_up(longest, alignment), alignment), failed_ranks


@dataclass(kw_only=True, slots=True, frozen=True)
class EqualizedTokens:
    """Token tensors padded to the group-uniform count S.

    Attributes:
        hidden: [S, H]; rows T.. are zeros.
        topk_ids: [S, K]; rows T.. are -1.
        topk_weights: [S, K]; rows T.. are 0 and carry no gradient.
        num_tokens: T, the real rows (always the leading rows).
    """

    hidden: Tensor
    topk_ids: Tensor
    topk_weights: Tensor
    num_tokens: int

    @property
    def padded_size(self) -> int:
        """S."""
        return int(self.hidden.shape[0])

    def valid_mask(self) -> Tensor:
        """[S] bool, True for real rows."""
        mask = torch.zeros(self.padded_size, dtype=torch.bool, device=self.hidden.device)
        mask[: self.num_tokens] = True
        return mask

    def unpad(self, rows: Tensor) -> Tensor:
        """[S, ...] -> [T, ...]: drop the padding rows."""
        return rows[: self.num_tokens]


def equalize_token_counts(
    hidden: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    alignment: int = HYBRID_EP_ALIGNMENT,
    padded_size: int | None = None,
) -> EqualizedTokens:
    """Pad this rank's tokens to the count S shared by the expert-parallel group.

    Args:
        hidden: [T, H].
        topk_ids: [T, K].
        topk_weights: [T, K].
        group: the expert-parallel group, for the MAX all-reduce.
        alignment: S is a multiple of this (default 4, what HybridEP requires).
        padded_size: S computed by the caller (e.g. once per step from the collated batch,
            or with :func:`padded_token_count`); skips the all-reduce. Must be the same on every
            rank, a multiple of ``alignment`` and >= T.

    Returns:
        The padded tensors; gradients flow to the real rows of hidden and topk_weights.
    """
    check_routing_shapes(hidden, topk_ids, topk_weights)
    num_tokens = int(hidden.shape[0])
    if padded_size is None:
        padded_size = padded_token_count(
            num_tokens, group=group, alignment=alignment, device=hidden.device
        )
    elif padded_size < num_tokens or padded_size % alignment != 0:
        raise ValueError(
            f"padded_size={padded_size} must be >= this rank's token count {num_tokens} and a "
            f"multiple of alignment={alignment}; pass the group-wide maximum rounded up to "
            f"{alignment} (padded_token_count computes it)"
        )
    extra = padded_size - num_tokens
    if extra == 0:
        return EqualizedTokens(
            hidden=hidden, topk_ids=topk_ids, topk_weights=topk_weights, num_tokens=num_tokens
        )
    return EqualizedTokens(
        hidden=F.pad(hidden, (0, 0, 0, extra)),
        topk_ids=F.pad(topk_ids, (0, 0, 0, extra), value=NO_EXPERT),
        topk_weights=F.pad(topk_weights, (0, 0, 0, extra)),
        num_tokens=num_tokens,
    )


class _EqualizesTokens:
    """What a dispatcher that pads every rank to the same token count holds and does.

    Attributes:
        group: the expert-parallel group (for the MAX all-reduce).
        alignment: padded counts are multiples of this.
        padded_size: a fixed S for every call (skips the all-reduce); None computes it per call.
    """

    group: dist.ProcessGroup | None
    alignment: int
    padded_size: int | None

    def _abort_padding(self, device: torch.device) -> bool:
        """Enter the padding exchange flagged as failed, so that the peers raise there.

        Returns:
            Whether the peers were told: False with a fixed ``padded_size``, where dispatch
            starts without that exchange.
        """
        if self.padded_size is not None:
            return False
        _exchange_padded_count(
            0, failed=True, group=self.group, alignment=self.alignment, device=device
        )
        return True

    def _equalize(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> EqualizedTokens:
        """:func:`equalize_token_counts` with this dispatcher's group, alignment and size."""
        return equalize_token_counts(
            hidden,
            topk_ids,
            topk_weights,
            group=self.group,
            alignment=self.alignment,
            padded_size=self.padded_size,
        )


@dataclass(slots=True)
class EqualizedHandle:
    """State kept between ``EqualizingDispatcher.dispatch`` and ``combine``."""

    inner: Any
    num_tokens: int


class EqualizingDispatcher(_EqualizesTokens):
    """Wraps any dispatcher so that every rank dispatches the same, aligned token count.

    Outputs equal those of the wrapped dispatcher without padding: padding rows reach no expert
    and are sliced off in ``combine``.

    Args:
        inner: the dispatcher that receives the padded tensors.
        group: the expert-parallel group (for the MAX all-reduce).
        alignment: padded counts are multiples of this.
        padded_size: a fixed S for every call (skips the all-reduce); None computes it per call.
    """

    def __init__(
        self,
        inner: Dispatcher,
        *,
        group: dist.ProcessGroup | None = None,
        alignment: int = HYBRID_EP_ALIGNMENT,
        padded_size: int | None = None,
    ) -> None:
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        self.inner = inner
        self.group = group
        self.alignment = alignment
        self.padded_size = padded_size
        self.num_experts = inner.num_experts
        self.num_local_experts = inner.num_local_experts
        self.local_expert_start = inner.local_expert_start

    def dispatch(
        self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> tuple[Tensor, Tensor, EqualizedHandle]:
        """See :meth:`moe_dispatch.Dispatcher.dispatch`; pads before dispatching."""
        padded = self._equalize(hidden, topk_ids, topk_weights)
        expert_input, counts, inner = self.inner.dispatch(
            padded.hidden, padded.topk_ids, padded.topk_weights
        )
        return expert_input, counts, EqualizedHandle(inner=inner, num_tokens=padded.num_tokens)

    def abort_dispatch(self, device: torch.device) -> None:
        """Flag dispatch's first collective as failed (see AllToAllDispatcher.abort_dispatch).

        That is the padding exchange, or with a fixed ``padded_size`` the inner dispatcher's.
        """
        if self._abort_padding(device):
            return
        abort = getattr(self.inner, "abort_dispatch", None)
        if abort is not None:
            abort(device)

    def combine(self, expert_output: Tensor, handle: EqualizedHandle) -> Tensor:
        """See :meth:`moe_dispatch.Dispatcher.combine`; returns only the real rows."""
        return self.inner.combine(expert_output, handle.inner)[: handle.num_tokens]
