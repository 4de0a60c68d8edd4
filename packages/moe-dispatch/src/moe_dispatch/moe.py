"""An expert-parallel MoE layer (router + grouped experts through any dispatcher).

Expert weights use the Hugging Face fused layout (transformers 5.x ``*Experts`` modules), so a
converted block is a slice, not a rewrite: ``gate_up_proj`` [E_local, 2F, H] holds the gate
rows then the up rows, ``down_proj`` [E_local, H, F].

# T tokens, H hidden, F expert intermediate size, E experts, K top-k, N rows sent to experts
"""

from __future__ import annotations

import copy
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_dispatch.dispatcher import Dispatcher, LocalDispatcher
from moe_dispatch.router_replay import RouterReplay

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
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    layer_id: int | None = None
    grouped_mm: GroupedMM = "auto"

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.grouped_mm not in ("auto", "always", "never"):
            raise ValueError(f"grouped_mm={self.grouped_mm!r}; use 'auto', 'always' or 'never'")


@dataclass(kw_only=True, slots=True, frozen=True)
class RouterOutput:
    """What a router decided for T tokens.

    Attributes:
        logits: [T, E] in the hidden dtype.
        probs: [T, E] float32 softmax (for auxiliary losses).
        topk_ids: [T, K] int64 global expert ids.
        topk_weights: [T, K] float32, gathered from ``probs`` (differentiable).
    """

    logits: Tensor
    probs: Tensor
    topk_ids: Tensor
    topk_weights: Tensor


class TopKRouter(nn.Module):
    """Softmax top-k router; replays recorded ids when bound to a :class:`RouterReplay`.

    Args:
        hidden_size: H.
        num_experts: E.
        top_k: K.
        norm_topk_prob: renormalise the K weights to sum to 1.
        layer_id: global layer id (router replay key).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        layer_id: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, device=device, dtype=dtype)
        )
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.layer_id = layer_id
        self.router_replay: RouterReplay | None = None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden: Tensor) -> RouterOutput:
        """Route [T, H] tokens."""
        logits = F.linear(hidden, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        if self.router_replay is None:
            topk_ids = torch.topk(probs.detach(), self.top_k, dim=-1).indices
        else:
            topk_ids = self.router_replay.select(self.layer_id, probs, self.top_k)
        # Gather from the full live probabilities (not top-k-zeroed ones) so replayed ids keep
        # the router's gradient.
        topk_weights = probs.gather(1, topk_ids)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return RouterOutput(
            logits=logits, probs=probs, topk_ids=topk_ids, topk_weights=topk_weights
        )


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
        if _use_grouped_mm(self.grouped_mm, hidden, self.gate_up_proj):
            offsets = torch.cumsum(tokens_per_expert.to(hidden.device), 0).to(torch.int32)
            gate_up = torch._grouped_mm(hidden, self.gate_up_proj.transpose(1, 2), offs=offsets)
            gate, up = gate_up.chunk(2, dim=-1)
            return torch._grouped_mm(
                self.act_fn(gate) * up, self.down_proj.transpose(1, 2), offs=offsets
            )
        # Every local expert runs, even on zero rows, so this rank's graph always reaches the
        # dispatch all-to-all and its backward collective runs on every rank.
        outputs = []
        for e, rows in enumerate(hidden.split(tokens_per_expert.tolist())):
            gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
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


def _hf_expert_weights(experts: Any) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """Global [E, 2F, H] gate_up and [E, H, F] down weights, and the activation, of HF experts."""
    if isinstance(experts, nn.ModuleList):
        # transformers 4.x: one MLP module per expert.
        mlps: list[Any] = list(experts)
        if hasattr(mlps[0], "w1"):  # Mixtral: w1 gate, w3 up, w2 down
            names = ("w1", "w3", "w2")
        elif hasattr(mlps[0], "gate_proj"):  # Qwen-MoE
            names = ("gate_proj", "up_proj", "down_proj")
        else:
            raise TypeError(
                f"unsupported per-expert module {type(mlps[0]).__name__}; expected w1/w2/w3 "
                "(Mixtral) or gate_proj/up_proj/down_proj (Qwen-MoE)"
            )
        stacked_gate_up = torch.stack(
            [torch.cat([getattr(m, names[0]).weight, getattr(m, names[1]).weight]) for m in mlps]
        )
        stacked_down = torch.stack([getattr(m, names[2]).weight for m in mlps])
        return stacked_gate_up, stacked_down, mlps[0].act_fn
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor) or gate_up.dim() != 3:
        raise TypeError(
            f"unsupported experts module {type(experts).__name__}; expected fused 3-D "
            "gate_up_proj/down_proj parameters (transformers 5.x) or an nn.ModuleList of MLPs"
        )
    if getattr(experts, "has_bias", False) or not getattr(experts, "has_gate", True):
        raise NotImplementedError(
            f"{type(experts).__name__} has expert biases or no gate; only bias-free gated "
            "MLP experts (Mixtral, Qwen2-MoE, Qwen3-MoE) convert"
        )
    if not getattr(experts, "is_concatenated", True):
        raise NotImplementedError(
            f"{type(experts).__name__} interleaves gate and up rows; only the concatenated "
            "[gate; up] layout converts"
        )
    if getattr(experts, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down, experts.act_fn


def from_hf_moe_block(
    block: nn.Module,
    *,
    dispatcher: Dispatcher | None = None,
    layer_id: int | None = None,
    grouped_mm: GroupedMM = "auto",
) -> ExpertParallelMoE:
    """Build an :class:`ExpertParallelMoE` from a Hugging Face sparse MoE block.

    Supports ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock`` (with its shared expert) and
    ``Qwen3MoeSparseMoeBlock``, in the transformers 5.x fused-expert layout or the 4.x
    per-expert ModuleList. On one process the result computes the same function as the block.

    Args:
        block: the HF block (left unchanged; weights are copied).
        dispatcher: the dispatcher of the new layer (default: one process).
        layer_id: global decoder-layer id, for router replay.
        grouped_mm: see :class:`MoEConfig`.
    """
    hf: Any = block  # transformers modules: attributes are checked at run time
    gate = hf.gate
    router_weight: Tensor = gate.weight
    num_experts, hidden_size = router_weight.shape
    top_k = getattr(gate, "top_k", None) or getattr(block, "top_k", None)
    if top_k is None:
        raise TypeError(f"{type(block).__name__} has no top_k on the block or its gate")
    if getattr(block, "jitter_noise", 0.0) and block.training:
        raise NotImplementedError(
            f"{type(block).__name__} uses router jitter noise {block.jitter_noise}; the "
            "expert-parallel layer has none: set router_jitter_noise=0 in the model config"
        )
    # Mixtral always renormalises; Qwen-MoE follows norm_topk_prob.
    norm = getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", True))
    gate_up, down, act_fn = _hf_expert_weights(hf.experts)
    config = MoEConfig(
        hidden_size=int(hidden_size),
        intermediate_size=int(down.shape[2]),
        num_experts=int(num_experts),
        top_k=int(top_k),
        norm_topk_prob=bool(norm),
        layer_id=layer_id,
        grouped_mm=grouped_mm,
    )
    shared = getattr(block, "shared_expert", None)
    shared_gate = getattr(block, "shared_expert_gate", None)
    moe = ExpertParallelMoE(
        config,
        dispatcher=dispatcher,
        act_fn=copy.deepcopy(act_fn),
        shared_expert=copy.deepcopy(shared) if shared is not None else None,
        shared_expert_gate=copy.deepcopy(shared_gate) if shared_gate is not None else None,
        device=router_weight.device,
        dtype=router_weight.dtype,
    )
    with torch.no_grad():
        moe.router.weight.copy_(router_weight)
    moe.load_experts(gate_up.detach(), down.detach())
    return moe


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def convert_hf_moe(
    model: nn.Module,
    *,
    dispatcher_factory: Callable[[int], Dispatcher] | None = None,
    grouped_mm: GroupedMM = "auto",
) -> list[int]:
    """Replace every HF sparse MoE block in ``model`` (in place) by an ExpertParallelMoE.

    A block is a module whose class name ends in ``SparseMoeBlock`` and that has ``gate`` and
    ``experts``. Its layer id is the decoder-layer index in its name (``...layers.<i>.mlp``).

    Args:
        model: a transformers model (or a pipeline part of one).
        dispatcher_factory: ``num_experts -> Dispatcher`` (default: one-process dispatch).
        grouped_mm: see :class:`MoEConfig`.

    Returns:
        The converted layer ids.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__.endswith("SparseMoeBlock")
        and hasattr(module, "gate")
        and hasattr(module, "experts")
    ]
    layer_ids = []
    for name, block in targets:
        match = _LAYER_INDEX.search(name + ".")
        if match is None:
            raise ValueError(
                f"cannot read a decoder-layer index from {name!r}; convert this block with "
                "from_hf_moe_block(..., layer_id=...) instead"
            )
        layer_id = int(match.group(1))
        num_experts = int(block.get_submodule("gate").weight.shape[0])
        dispatcher = dispatcher_factory(num_experts) if dispatcher_factory is not None else None
        new = from_hf_moe_block(
            block, dispatcher=dispatcher, layer_id=layer_id, grouped_mm=grouped_mm
        )
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        layer_ids.append(layer_id)
    return layer_ids
