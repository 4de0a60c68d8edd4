"""Dispatch through DeepEP's HybridEP buffer (CUDA only, optional ``hybridep`` extra).

HybridEP fuses permute + all-to-all (``dispatch_with_permute``) and unpermute + reduce
(``combine_with_unpermute``). It needs the same, 4-aligned token count on every rank of the
group, so tokens are equalized first (:func:`moe_dispatch.equalize_token_counts`); padding rows
route nowhere and are sliced off in ``combine``.

Routing weights are not given to HybridEP's combine: the dispatched per-row probabilities
scale the expert outputs before the (unweighted) combine, so the gradient of ``topk_weights``
flows back through HybridEP's dispatch backward (which combines the probability gradients).

Written against the ``HybridEPBuffer`` Python API of DeepEP's ``hybrid-ep`` branch
(``dispatch_with_permute`` / ``combine_with_unpermute`` with a dense ``routing_map`` [T, E] and
float32 ``probs`` [T, E]).

# T tokens, S padded tokens, H hidden, K top-k, E experts, T' rows received
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moe_dispatch.all_to_all import _OwnsGroupExperts
from moe_dispatch.equalize import HYBRID_EP_ALIGNMENT, _EqualizesTokens
from moe_dispatch.routing import check_routing_shapes

logger = logging.getLogger(__name__)

_INSTALL_HINT = (
    "HybridEPDispatcher needs DeepEP's HybridEP kernels (module 'deep_ep', the 'hybridep' "
    "extra of moe-dispatch). DeepEP is not on PyPI: clone github.com/deepseek-ai/DeepEP, check "
    "out the 'hybrid-ep' branch and build it against your torch and CUDA with "
    "`pip install --no-build-isolation .`; or use AllToAllDispatcher, which needs only torch"
)


def import_deep_ep() -> Any:
    """Import ``deep_ep`` lazily; raise an ImportError with install steps when it is missing."""
    try:
        import deep_ep
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    if not hasattr(deep_ep, "HybridEPBuffer"):
        raise ImportError(
            f"the installed deep_ep ({getattr(deep_ep, '__file__', '?')}) has no HybridEPBuffer; "
            + _INSTALL_HINT
        )
    return deep_ep


class _HybridDispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        probs: Tensor,
        routing_map: Tensor,
        buffer: Any,
        num_local_experts: int,
    ) -> tuple[Tensor, Tensor, Tensor, Any]:
        out_hidden, out_probs, _, tokens_per_expert, handle = buffer.dispatch_with_permute(
            hidden=hidden,
            routing_map=routing_map,
            probs=probs,
            num_of_experts_per_rank=num_local_experts,
        )
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.mark_non_differentiable(tokens_per_expert)
        return out_hidden, out_probs, tokens_per_expert, handle

    @staticmethod
    def backward(
        ctx: Any, grad_hidden: Tensor, grad_probs: Tensor | None, *_: Any
    ) -> tuple[Tensor, Tensor | None, None, None, None]:
        combined, combined_probs = ctx.buffer.combine_with_unpermute(
            hidden=grad_hidden.contiguous(),
            probs=grad_probs.float().contiguous() if grad_probs is not None else None,
            handle=ctx.handle,
        )
        return combined, combined_probs, None, None, None


class _HybridCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, expert_output: Tensor, buffer: Any, handle: Any) -> Tensor:
        combined, _ = buffer.combine_with_unpermute(hidden=expert_output, handle=handle)
        ctx.buffer = buffer
        ctx.handle = handle
        return combined

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        dispatched, _, _, _, _ = ctx.buffer.dispatch_with_permute(
            hidden=grad.contiguous(), handle=ctx.handle
        )
        return dispatched, None, None


@dataclass(slots=True)
class HybridEPHandle:
    """State kept between ``HybridEPDispatcher.dispatch`` and ``combine``."""

    buffer_handle: Any
    dispatched_probs: Tensor
    num_tokens: int


class HybridEPDispatcher(_OwnsGroupExperts, _EqualizesTokens):
    """Dispatcher over DeepEP's HybridEP kernels, with per-rank token equalization.

    Args:
        ep_group: the expert-parallel process group (NCCL, at least 2 ranks).
        num_experts: E, divisible by the group size.
        alignment: padded per-rank counts are multiples of this (HybridEP requires 4).
        padded_size: a group-uniform S computed once per step by the caller (skips the MAX
            all-reduce); None computes it on every dispatch.
        max_tokens_per_rank: initial buffer size (default: the first call's S; HybridEP grows
            the buffer when a later call is larger).
        num_sms_dispatch: SMs for the dispatch kernel (None: HybridEP's default).
        num_sms_combine: SMs for the combine kernel (None: HybridEP's default).
        buffer_factory: builds the buffer from HybridEPBuffer's keyword arguments; None uses
            ``deep_ep.HybridEPBuffer`` (and requires CUDA 16-bit tokens). Another factory must
            honour the same dispatch_with_permute / combine_with_unpermute contract.

    Raises:
        ImportError: ``deep_ep`` with HybridEP is not installed (names the ``hybridep`` extra).
    """

    def __init__(
        self,
        ep_group: dist.ProcessGroup | None,
        num_experts: int,
        *,
        alignment: int = HYBRID_EP_ALIGNMENT,
        padded_size: int | None = None,
        max_tokens_per_rank: int | None = None,
        num_sms_dispatch: int | None = None,
        num_sms_combine: int | None = None,
        buffer_factory: Callable[..., Any] | None = None,
    ) -> None:
        self._kernel_checks = buffer_factory is None
        if buffer_factory is None:
            buffer_factory = import_deep_ep().HybridEPBuffer
        self._buffer_factory = buffer_factory
        if alignment % HYBRID_EP_ALIGNMENT != 0:
            raise ValueError(
                f"alignment={alignment} breaks HybridEP, whose per-rank token count must be a "
                f"multiple of {HYBRID_EP_ALIGNMENT}; use a multiple of {HYBRID_EP_ALIGNMENT}"
            )
        self._own_experts(ep_group if ep_group is not None else dist.group.WORLD, num_experts)
        if self.ep_size < 2:
            raise ValueError(
                f"HybridEP needs an expert-parallel group of at least 2 ranks, got {self.ep_size}; "
                "use LocalDispatcher on one rank"
            )
        self.alignment = alignment
        self.padded_size = padded_size
        self.max_tokens_per_rank = max_tokens_per_rank
        self.num_sms_dispatch = num_sms_dispatch
        self.num_sms_combine = num_sms_combine
        self._buffer: Any = None

    def _get_buffer(self, hidden_size: int, num_tokens: int) -> Any:
        if self._buffer is None:
            kwargs: dict[str, Any] = {}
            if self.num_sms_dispatch is not None:
                kwargs["num_sms_dispatch_api"] = self.num_sms_dispatch
            if self.num_sms_combine is not None:
                kwargs["num_sms_combine_api"] = self.num_sms_combine
            self._buffer = self._buffer_factory(
                group=self.group,
                hidden_dim=hidden_size,
                max_num_of_tokens_per_rank=max(self.max_tokens_per_rank or 0, num_tokens),
                num_local_experts=self.num_local_experts,
                use_fp8=False,
                **kwargs,
            )
        return self._buffer

    def dispatch(
        self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> tuple[Tensor, Tensor, HybridEPHandle]:
        """See :meth:`moe_dispatch.Dispatcher.dispatch`."""
        check_routing_shapes(hidden, topk_ids, topk_weights)
        if self._kernel_checks and not hidden.is_cuda:
            raise ValueError(f"HybridEP runs on CUDA tensors; hidden is on {hidden.device}")
        if self._kernel_checks and hidden.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"HybridEP moves 16-bit tokens; hidden is {hidden.dtype}: cast it to bfloat16 "
                "(or use AllToAllDispatcher for float32)"
            )
        padded = self._equalize(hidden, topk_ids, topk_weights)
        num_padded = padded.padded_size
        ids = padded.topk_ids.long()
        real = ids >= 0
        safe_ids = ids.clamp(min=0)
        # Dense routing: padding slots (id -1) stay all-False with zero probability.
        routing_map = torch.zeros(
            num_padded, self.num_experts, dtype=torch.bool, device=hidden.device
        ).scatter(1, safe_ids, real)
        probs = torch.zeros(
            num_padded, self.num_experts, dtype=torch.float32, device=hidden.device
        ).scatter_add(1, safe_ids, padded.topk_weights.float() * real)
        buffer = self._get_buffer(hidden.shape[1], num_padded)
        expert_input, dispatched_probs, tokens_per_expert, buffer_handle = _HybridDispatch.apply(
            padded.hidden.contiguous(), probs, routing_map, buffer, self.num_local_experts
        )
        dispatched_probs = dispatched_probs.reshape(-1)
        if dispatched_probs.numel() != expert_input.shape[0]:
            raise RuntimeError(
                f"HybridEP returned {dispatched_probs.numel()} probabilities for "
                f"{expert_input.shape[0]} rows; this deep_ep version's dispatch_with_permute "
                "output layout is not supported"
            )
        handle = HybridEPHandle(
            buffer_handle=buffer_handle,
            dispatched_probs=dispatched_probs,
            num_tokens=padded.num_tokens,
        )
        counts = tokens_per_expert.to(device=hidden.device, dtype=torch.long)
        return expert_input, counts, handle

    def abort_dispatch(self, device: torch.device) -> None:
        """Enter dispatch's padding exchange flagged as failed, so peers raise instead of waiting.

        Call it when this rank cannot dispatch (e.g. its router raised), then raise locally.
        With a fixed ``padded_size`` no collective precedes HybridEP's kernels, so the peers
        cannot be told: they wait in the kernels until the job is stopped (a warning says so).
        """
        if not self._abort_padding(device):
            logger.warning(
                "HybridEPDispatcher with a fixed padded_size cannot tell its peers that this "
                "rank failed before dispatch; they wait in HybridEP's kernels until the job is "
                "stopped (leave padded_size=None to have every rank raise)"
            )

    def combine(self, expert_output: Tensor, handle: HybridEPHandle) -> Tensor:
        """See :meth:`moe_dispatch.Dispatcher.combine`."""
        weights = handle.dispatched_probs.to(torch.float32).unsqueeze(1)
        weighted = (expert_output.float() * weights).to(expert_output.dtype)
        combined = _HybridCombine.apply(weighted.contiguous(), self._buffer, handle.buffer_handle)
        return combined[: handle.num_tokens]
