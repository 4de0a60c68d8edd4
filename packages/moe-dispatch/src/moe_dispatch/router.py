"""Top-k routers: softmax (Mixtral, Qwen-MoE) and sigmoid with group-limited top-k (DeepSeek-V3).

# T tokens, H hidden, E experts, K top-k, G expert groups
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_dispatch.router_replay import RouterReplay
from moe_dispatch.routing import expert_load

ScoreFunc = Literal["softmax", "sigmoid"]


@dataclass(kw_only=True, slots=True, frozen=True)
class RouterOutput:
    """What a router decided for T tokens.

    Attributes:
        logits: [T, E] router logits (the hidden dtype; float32 for sigmoid routers, which
            compute them in float32 like DeepSeek-V3).
        probs: [T, E] float32 scores: the softmax, or the sigmoid scores without the
            correction bias (for auxiliary losses).
        topk_ids: [T, K] int64 global expert ids.
        topk_weights: [T, K] float32, gathered from ``probs`` (differentiable), renormalised
            and scaled as configured.
    """

    logits: Tensor
    probs: Tensor
    topk_ids: Tensor
    topk_weights: Tensor


class TopKRouter(nn.Module):
    """Top-k router; replays recorded ids when bound to a :class:`RouterReplay`.

    ``score_func="softmax"``: ids are the top-k of the softmax (Mixtral, Qwen-MoE).
    ``score_func="sigmoid"``: DeepSeek-V3 routing. Scores are ``sigmoid(logits)``; the choice
    adds the ``score_correction_bias`` buffer (aux-loss-free balancing, updated by
    :func:`update_score_correction_bias`, never by the optimizer), keeps the ``topk_group`` of
    ``num_groups`` expert groups with the largest sum of their two best scores, and takes the
    top-k inside them. The weights are the unbiased scores of the chosen experts, renormalised
    when ``norm_topk_prob``, times ``routed_scaling_factor``.

    Args:
        hidden_size: H.
        num_experts: E.
        top_k: K.
        norm_topk_prob: renormalise the K weights to sum to 1.
        layer_id: global layer id (router replay key).
        score_func: "softmax" or "sigmoid".
        num_groups: G expert groups (sigmoid routing; E % G == 0).
        topk_group: groups kept per token (sigmoid routing).
        routed_scaling_factor: factor on the routed weights.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        layer_id: int | None = None,
        score_func: ScoreFunc = "softmax",
        num_groups: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_routing_config(
            num_experts=num_experts,
            top_k=top_k,
            score_func=score_func,
            num_groups=num_groups,
            topk_group=topk_group,
        )
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, device=device, dtype=dtype)
        )
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.layer_id = layer_id
        self.score_func: ScoreFunc = score_func
        self.num_groups = num_groups
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.router_replay: RouterReplay | None = None
        self.score_correction_bias: Tensor | None
        if score_func == "sigmoid":
            self.register_buffer(
                "score_correction_bias",
                torch.zeros(num_experts, device=device, dtype=torch.float32),
            )
        else:
            self.score_correction_bias = None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def _select(self, choice: Tensor) -> Tensor:
        if self.router_replay is None:
            return torch.topk(choice.detach(), self.top_k, dim=-1).indices
        return self.router_replay.select(self.layer_id, choice, self.top_k)

    def forward(self, hidden: Tensor) -> RouterOutput:
        """Route [T, H] tokens."""
        if self.score_func == "softmax":
            logits = F.linear(hidden, self.weight)
            probs = torch.softmax(logits.float(), dim=-1)
            topk_ids = self._select(probs)
        else:
            logits = F.linear(hidden.float(), self.weight.float())
            probs = logits.sigmoid()
            topk_ids = self._select(self._grouped_choice(probs.detach()))
        # Gather from the full live probabilities (not top-k-zeroed ones) so replayed ids keep
        # the router's gradient.
        topk_weights = probs.gather(1, topk_ids)
        if self.norm_topk_prob:
            # The tiny epsilon (DeepSeek-V3's) only matters for all-zero sigmoid scores.
            eps = 1e-20 if self.score_func == "sigmoid" else 0.0
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + eps)
        if self.routed_scaling_factor != 1.0:
            topk_weights = topk_weights * self.routed_scaling_factor
        return RouterOutput(
            logits=logits, probs=probs, topk_ids=topk_ids, topk_weights=topk_weights
        )

    def _grouped_choice(self, scores: Tensor) -> Tensor:
        """[T, E] choice scores: biased, with experts outside the kept groups at -inf."""
        assert self.score_correction_bias is not None
        choice = scores + self.score_correction_bias
        if self.num_groups == 1:
            return choice
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, self.num_groups, num_experts // self.num_groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        kept = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        expert_mask = mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        return choice.masked_fill(~expert_mask, float("-inf"))


def check_routing_config(
    *, num_experts: int, top_k: int, score_func: str, num_groups: int, topk_group: int
) -> None:
    """Raise a ValueError for an inconsistent routing configuration."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"score_func={score_func!r}; use 'softmax' or 'sigmoid'")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"num_groups={num_groups} must be >= 1 and divide num_experts={num_experts}"
        )
    if num_groups > 1 and score_func != "sigmoid":
        raise ValueError("group-limited routing (num_groups > 1) needs score_func='sigmoid'")
    if num_groups > 1:
        if not 1 <= topk_group <= num_groups:
            raise ValueError(f"topk_group={topk_group} must be in [1, num_groups={num_groups}]")
        if top_k > topk_group * (num_experts // num_groups):
            raise ValueError(
                f"top_k={top_k} exceeds the {topk_group * (num_experts // num_groups)} experts "
                f"of the {topk_group} kept groups; raise topk_group or lower top_k"
            )


@torch.no_grad()
def update_score_correction_bias(router: TopKRouter, topk_ids: Tensor, *, rate: float) -> Tensor:
    """DeepSeek-V3's aux-loss-free balancing step: ``bias += rate * sign(mean_load - load)``.

    Call it after the optimizer step with the routes of the step (all ranks must pass the
    same, globally summed load, e.g. ids gathered or the load all-reduced first: pass
    ``topk_ids`` as the global ids or use :func:`expert_load` and all-reduce).

    Args:
        router: a sigmoid router (it holds ``score_correction_bias``).
        topk_ids: [T, K] the step's routed ids (-1 rows are not counted), or an [E] load.
        rate: the bias update speed (DeepSeek-V3: 1e-3).

    Returns:
        [E] float32 the load used.
    """
    if router.score_correction_bias is None:
        raise ValueError(
            "this router has no score_correction_bias (score_func='softmax'); aux-loss-free "
            "balancing needs a sigmoid router"
        )
    num_experts = router.weight.shape[0]
    if topk_ids.dim() == 1:
        if topk_ids.numel() != num_experts:
            raise ValueError(f"load has {topk_ids.numel()} entries, expected {num_experts}")
        load = topk_ids.float()
    else:
        load = expert_load(topk_ids, num_experts).float()
    load = load.to(router.score_correction_bias.device)
    router.score_correction_bias.add_(rate * torch.sign(load.mean() - load))
    return load
