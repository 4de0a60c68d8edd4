"""A pure-torch stand-in for DeepEP's HybridEPBuffer, for CPU tests of HybridEPDispatcher.

It follows the Python contract of ``HybridEPBuffer`` on DeepEP's hybrid-ep branch
(dense ``routing_map`` [S, E] and float32 ``probs`` [S, E] in, rows permuted by local expert
out; ``combine_with_unpermute`` sums rows back per token) and enforces HybridEP's input rule:
the same, 4-aligned token count S on every rank. It does not model the real kernels'
performance or numerics; the real buffer is exercised only by the CUDA tests.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moe_dispatch.all_to_all import _exchange
from moe_dispatch.routing import group_major_to_expert_major, inverse_permutation


class EmulatedHybridEPBuffer:
    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        **_: Any,
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.num_local_experts = num_local_experts
        self.hidden_dim = hidden_dim
        self.dispatch_sizes: list[int] = []

    def dispatch_with_permute(
        self,
        *,
        hidden: Tensor,
        routing_map: Tensor | None = None,
        probs: Tensor | None = None,
        num_of_experts_per_rank: int | None = None,
        handle: dict[str, Any] | None = None,
        **_: Any,
    ) -> tuple[Tensor, Tensor | None, None, Tensor, dict[str, Any]]:
        if handle is None:
            assert routing_map is not None and routing_map.dtype == torch.bool
            num_tokens = hidden.shape[0]
            sizes: list[Any] = [None] * self.world
            dist.all_gather_object(sizes, num_tokens, group=self.group)
            # The real kernels abort or hang here; the emulation fails loudly instead.
            assert len(set(sizes)) == 1, f"HybridEP needs uniform per-rank counts, got {sizes}"
            assert num_tokens % 4 == 0, f"HybridEP needs counts that are multiples of 4: {sizes}"
            self.dispatch_sizes.append(num_tokens)
            token, expert = routing_map.nonzero(as_tuple=True)
            order = torch.argsort(expert, stable=True)
            token, expert = token[order], expert[order]
            counts = torch.bincount(expert, minlength=routing_map.shape[1])
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=self.group)
            recv_2d = recv.view(self.world, self.num_local_experts)
            handle = {
                "token": token,
                "expert": expert,
                "send": counts.view(self.world, -1).sum(1).tolist(),
                "recv": recv_2d.sum(1).tolist(),
                "regroup": group_major_to_expert_major(recv_2d),
                "num_tokens": num_tokens,
                "num_experts": routing_map.shape[1],
                "tokens_per_expert": recv_2d.sum(0),
            }
        h = handle
        out_hidden = _exchange(hidden[h["token"]], h["recv"], h["send"], self.group)[h["regroup"]]
        out_probs = None
        if probs is not None:
            picked = probs[h["token"], h["expert"]]
            out_probs = _exchange(picked, h["recv"], h["send"], self.group)[h["regroup"]]
        return out_hidden, out_probs, None, h["tokens_per_expert"], h

    def combine_with_unpermute(
        self,
        *,
        hidden: Tensor,
        probs: Tensor | None = None,
        handle: dict[str, Any],
        **_: Any,
    ) -> tuple[Tensor, Tensor | None]:
        h = handle
        inverse = inverse_permutation(h["regroup"])
        back = _exchange(hidden[inverse], h["send"], h["recv"], self.group)
        combined = hidden.new_zeros(h["num_tokens"], hidden.shape[1]).index_add(0, h["token"], back)
        combined_probs = None
        if probs is not None:
            back_probs = _exchange(probs[inverse], h["send"], h["recv"], self.group)
            combined_probs = torch.zeros(
                h["num_tokens"], h["num_experts"], dtype=torch.float32
            ).index_put((h["token"], h["expert"]), back_probs.float(), accumulate=True)
        return combined, combined_probs
