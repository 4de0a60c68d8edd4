"""An expert-parallel MoE layer (router + grouped experts through any dispatcher).

Expert weights use the Hugging Face fused layout (transformers 5.x ``*Experts`` modules), so a
converted block is a slice, not a rewrite: ``gate_up_proj`` [E_local, 2F, H] holds the gate
rows then the up rows, ``down_proj`` [E_local, H, F].

# T tokens, H hidden, F expert intermediate size, E experts, K top-k, N rows sent to experts
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_dispatch.dispatcher import Dispatcher, LocalDispatcher
from moe_dispatch.router import RouterOutput, ScoreFunc, TopKRouter, check_routing_config

logger = logging.getLogger(__name__)

GroupedMM = Literal["auto", "always", "never"]


@dataclass(kw_only=True, slots=True, frozen=True)
class MoEConfig:
    """Shape and routing of one MoE layer.

    Attributes:
        hidden_size: H.
        intermediate_size: F, per expert.
        num_experts: E, global.
        top_k: K experts per token.
        norm_topk_prob: renormalise the K gathered probabilities to sum to 1 (Mixtral: always;
            Qwen-MoE: the config's ``norm_topk_prob``).
        layer_id: global decoder-layer id, the key for router replay.
        grouped_mm: "auto" uses ``torch._grouped_mm`` on CUDA for 16-bit weights, "always" on
            CUDA whatever the dtype, "never" loops over local experts.
        score_func: "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3, with a
            score-correction bias); see :class:`TopKRouter`.
        num_groups: expert groups of group-limited routing (sigmoid only; 1 = none).
        topk_group: groups kept per token.
        routed_scaling_factor: factor on the routed weights (DeepSeek-V3's).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    layer_id: int | None = None
    grouped_mm: GroupedMM = "auto"
    score_func: ScoreFunc = "softmax"
    num_groups: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        check_routing_config(
            num_experts=self.num_experts,
            top_k=self.top_k,
            score_func=self.score_func,
            num_groups=self.num_groups,
            topk_group=self.topk_group,
        )
        if self.grouped_mm not in ("auto", "always", "never"):
            raise ValueError(f"grouped_mm={self.grouped_mm!r}; use 'auto', 'always' or 'never'")


def _use_grouped_mm(mode: GroupedMM, x: Tensor, weight: Tensor) -> bool:
    if mode == "never" or not x.is_cuda or not hasattr(torch, "_grouped_mm"):
        return False
    if mode == "always":
        return True
    return weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype


class GroupedExperts(nn.Module):
    """E_local gated-MLP experts: ``down(act(gate(x)) * up(x))``, weights in the HF fused layout.

    Args:
        num_local_experts: E_local.
        hidden_size: H.
        intermediate_size: F.
        act_fn: the activation (default SiLU, i.e. SwiGLU).
        grouped_mm: see :class:`MoEConfig`.
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        act_fn: Callable[[Tensor], Tensor] | None = None,
        grouped_mm: GroupedMM = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_local_experts, 2 * intermediate_size, hidden_size, **factory)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_local_experts, hidden_size, intermediate_size, **factory)
        )
        self.act_fn: Callable[[Tensor], Tensor] = act_fn if act_fn is not None else nn.SiLU()
        self.grouped_mm = grouped_mm
        bound_in = 1 / math.sqrt(hidden_size)
        bound_out = 1 / math.sqrt(intermediate_size)
        nn.init.uniform_(self.gate_up_proj, -bound_in, bound_in)
        nn.init.uniform_(self.down_proj, -bound_out, bound_out)

    @property
    def num_local_experts(self) -> int:
        """E_local."""
        return int(self.gate_up_proj.shape[0])

    def forward(self, hidden: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """Run each row through its expert.

        Args:
            hidden: [N, H], rows grouped by local expert.
            tokens_per_expert: [E_local] row counts of the groups (sum N).

        Returns:
            [N, H].
        """
        if tokens_per_expert.numel() != self.num_local_experts:
            raise ValueError(
                f"tokens_per_expert has {tokens_per_expert.numel()} entries, expected one per "
                f"local expert ({self.num_local_experts})"
            )
        gate_up_proj: Tensor = self.gate_up_proj
        down_proj: Tensor = self.down_proj
        if gate_up_proj.dtype != hidden.dtype:
            # Mixed precision with the experts outside FSDP2 (expert parallelism): compute in
            # the activations' dtype, keep the master weights (and their gradients) as they are.
            gate_up_proj, down_proj = gate_up_proj.to(hidden.dtype), down_proj.to(hidden.dtype)
        if _use_grouped_mm(self.grouped_mm, hidden, gate_up_proj):
            offsets = torch.cumsum(tokens_per_expert.to(hidden.device), 0).to(torch.int32)
            gate_up = torch._grouped_mm(hidden, gate_up_proj.transpose(1, 2), offs=offsets)
            gate, up = gate_up.chunk(2, dim=-1)
            return torch._grouped_mm(
                self.act_fn(gate) * up, down_proj.transpose(1, 2), offs=offsets
            )
        # Every local expert runs, even on zero rows, so this rank's graph always reaches the
        # dispatch all-to-all and its backward collective runs on every rank.
        outputs = []
        for e, rows in enumerate(hidden.split(tokens_per_expert.tolist())):
            gate, up = F.linear(rows, gate_up_proj[e]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, down_proj[e]))
        return torch.cat(outputs) if outputs else hidden[:0]


class ExpertParallelMoE(nn.Module):
    """Router + grouped experts, with experts sharded by index across the dispatcher's group.

    Example::

        dispatcher = AllToAllDispatcher(ep_group, num_experts=8)
        moe = ExpertParallelMoE(MoEConfig(hidden_size=64, intermediate_size=128,
                                          num_experts=8, top_k=2), dispatcher=dispatcher)
        moe.load_experts(gate_up_proj_all, down_proj_all)   # [E, 2F, H], [E, H, F]: keeps the local slice
        out = moe(hidden)                                     # [..., H] -> [..., H]

    Args:
        config: the layer's shape and routing.
        dispatcher: how tokens reach experts (default: :class:`LocalDispatcher`, one process).
        act_fn: expert activation (default SiLU).
        shared_expert: optional always-on MLP added to the routed output (Qwen2-MoE).
        shared_expert_gate: optional [H -> 1] module; the shared output is scaled by its sigmoid.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        dispatcher: Dispatcher | None = None,
        act_fn: Callable[[Tensor], Tensor] | None = None,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dispatcher is None:
            dispatcher = LocalDispatcher(config.num_experts)
        if dispatcher.num_experts != config.num_experts:
            raise ValueError(
                f"dispatcher routes {dispatcher.num_experts} experts but the config has "
                f"{config.num_experts}; build the dispatcher with num_experts={config.num_experts}"
            )
        self.config = config
        self.dispatcher = dispatcher
        self.router = TopKRouter(
            config.hidden_size,
            config.num_experts,
            config.top_k,
            norm_topk_prob=config.norm_topk_prob,
            layer_id=config.layer_id,
            score_func=config.score_func,
            num_groups=config.num_groups,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
            device=device,
            dtype=dtype,
        )
        self.experts = GroupedExperts(
            dispatcher.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            act_fn=act_fn,
            grouped_mm=config.grouped_mm,
            device=device,
            dtype=dtype,
        )
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        #: Set by the HF converter: how to write this layer back in the HF layout.
        self.hf_layout: dict[str, Any] | None = None
        #: Set by :func:`moe_dispatch.collect_routing`: receives each forward's RouterOutput.
        self.routing_sink: list[RouterOutput] | None = None
        #: Set by the HF converter: called with each forward's [T, E] router logits, so that
        #: transformers' ``output_router_logits`` hooks record them (see ``hf.py``).
        self.router_logits_relay: nn.Module | None = None

    @property
    def local_experts(self) -> range:
        """Global ids of the experts held by this rank."""
        start = self.dispatcher.local_expert_start
        return range(start, start + self.dispatcher.num_local_experts)

    @torch.no_grad()
    def load_experts(self, gate_up_proj: Tensor, down_proj: Tensor) -> None:
        """Copy this rank's slice of the global expert weights.

        Args:
            gate_up_proj: [E, 2F, H] (gate rows, then up rows).
            down_proj: [E, H, F].
        """
        local = self.local_experts
        expected_gu = (self.config.num_experts, *self.experts.gate_up_proj.shape[1:])
        expected_d = (self.config.num_experts, *self.experts.down_proj.shape[1:])
        if tuple(gate_up_proj.shape) != expected_gu or tuple(down_proj.shape) != expected_d:
            raise ValueError(
                f"global expert weights have shapes {tuple(gate_up_proj.shape)} and "
                f"{tuple(down_proj.shape)}, expected {expected_gu} and {expected_d}"
            )
        self.experts.gate_up_proj.copy_(gate_up_proj[local.start : local.stop])
        self.experts.down_proj.copy_(down_proj[local.start : local.stop])

    @torch.no_grad()
    def gather_experts(self) -> tuple[Tensor, Tensor]:
        """The global expert weights, gathered from every rank of the dispatcher's group.

        A collective over that group when it has more than one rank (call it on every rank).

        Returns:
            gate_up_proj [E, 2F, H] and down_proj [E, H, F], detached copies.
        """
        gate_up = self.experts.gate_up_proj.detach()
        down = self.experts.down_proj.detach()
        group = getattr(self.dispatcher, "group", None)
        inner = getattr(self.dispatcher, "inner", None)  # EqualizingDispatcher
        if group is None and inner is not None:
            group = getattr(inner, "group", None)
        if self.dispatcher.num_local_experts == self.config.num_experts:
            return gate_up.clone(), down.clone()
        import torch.distributed as dist

        size = dist.get_world_size(group)
        parts_gu = [torch.empty_like(gate_up) for _ in range(size)]
        parts_d = [torch.empty_like(down) for _ in range(size)]
        dist.all_gather(parts_gu, gate_up.contiguous(), group=group)
        dist.all_gather(parts_d, down.contiguous(), group=group)
        return torch.cat(parts_gu), torch.cat(parts_d)

    def forward_with_routing(self, hidden: Tensor) -> tuple[Tensor, RouterOutput]:
        """Like :meth:`forward`, also returning the router's decision (for auxiliary losses).

        Args:
            hidden: [..., H]; the leading dims may hold 0 tokens.

        Returns:
            [..., H] output and the :class:`RouterOutput` over the flattened [T, H] tokens.
        """
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        try:
            routing = self.router(x)
        except (ValueError, KeyError, RuntimeError):
            # E.g. an invalid router-replay recording on this rank only: let the peers fail in
            # dispatch's first collective instead of waiting there forever.
            abort = getattr(self.dispatcher, "abort_dispatch", None)
            if abort is not None:
                abort(x.device)
            raise
        if self.routing_sink is not None and torch._C._current_graph_task_id() == -1:
            # Not during backward: a checkpoint recompute must not be collected twice.
            self.routing_sink.append(routing)
        if self.router_logits_relay is not None:
            self.router_logits_relay(routing.logits)
        expert_input, counts, handle = self.dispatcher.dispatch(
            x, routing.topk_ids, routing.topk_weights
        )
        out = self.dispatcher.combine(self.experts(expert_input, counts), handle)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.reshape(shape), routing

    def forward(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [..., H]."""
        return self.forward_with_routing(hidden)[0]
