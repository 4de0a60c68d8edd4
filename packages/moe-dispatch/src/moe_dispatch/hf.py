"""Hugging Face MoE blocks <-> :class:`ExpertParallelMoE`: conversion and export back.

Supported blocks: ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock`` (shared expert and its
gate), ``Qwen3MoeSparseMoeBlock`` and ``DeepseekV3MoE`` (sigmoid scores, group-limited top-k,
score-correction bias, shared experts), in the transformers 5.x fused-expert layout or the 4.x
per-expert ``nn.ModuleList``.

# E experts, H hidden, F expert intermediate size
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from moe_dispatch.dispatcher import Dispatcher
from moe_dispatch.moe import ExpertParallelMoE, GroupedMM, MoEConfig

#: HF block class -> the name of its shared expert module (None: no shared expert).
SUPPORTED_BLOCKS: dict[str, str | None] = {
    "MixtralSparseMoeBlock": None,
    "Qwen2MoeSparseMoeBlock": "shared_expert",
    "Qwen3MoeSparseMoeBlock": None,
    "DeepseekV3MoE": "shared_experts",
}

#: transformers ``model_type`` values whose MoE blocks convert.
SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def _hf_expert_weights(experts: Any) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor], bool]:
    """The global expert weights of an HF MoE block, its activation and its storage layout.

    Returns:
        [E, 2F, H] gate_up weights, [E, H, F] down weights, the activation, and whether the
        HF tensors are stored transposed.
    """
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
        return stacked_gate_up, stacked_down, mlps[0].act_fn, False
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
            "MLP experts (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) convert"
        )
    if not getattr(experts, "is_concatenated", True):
        raise NotImplementedError(
            f"{type(experts).__name__} interleaves gate and up rows; only the concatenated "
            "[gate; up] layout converts"
        )
    transposed = bool(getattr(experts, "is_transposed", False))
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down, experts.act_fn, transposed


def from_hf_moe_block(
    block: nn.Module,
    *,
    dispatcher: Dispatcher | None = None,
    layer_id: int | None = None,
    grouped_mm: GroupedMM = "auto",
) -> ExpertParallelMoE:
    """Build an :class:`ExpertParallelMoE` from a Hugging Face sparse MoE block.

    See :data:`SUPPORTED_BLOCKS`. On one process the result computes the same function as the
    block; with an expert-parallel dispatcher it keeps this rank's experts only. The block is
    left unchanged (weights are copied).

    Args:
        block: the HF block.
        dispatcher: the dispatcher of the new layer (default: one process).
        layer_id: global decoder-layer id, for router replay.
        grouped_mm: see :class:`MoEConfig`.
    """
    hf: Any = block  # transformers modules: attributes are checked at run time
    kind = type(block).__name__
    gate = hf.gate
    router_weight: Tensor = gate.weight
    num_experts, hidden_size = router_weight.shape
    top_k = getattr(gate, "top_k", None) or getattr(block, "top_k", None)
    if top_k is None:
        raise TypeError(f"{kind} has no top_k on the block or its gate")
    if getattr(block, "jitter_noise", 0.0) and block.training:
        raise NotImplementedError(
            f"{kind} uses router jitter noise {block.jitter_noise}; the expert-parallel layer "
            "has none: set router_jitter_noise=0 in the model config"
        )
    # Mixtral always renormalises; Qwen-MoE and DeepSeek follow norm_topk_prob.
    norm = getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", True))
    gate_up, down, act_fn, transposed = _hf_expert_weights(hf.experts)
    bias = getattr(gate, "e_score_correction_bias", None)
    sigmoid = bias is not None
    config = MoEConfig(
        hidden_size=int(hidden_size),
        intermediate_size=int(down.shape[2]),
        num_experts=int(num_experts),
        top_k=int(top_k),
        norm_topk_prob=bool(norm),
        layer_id=layer_id,
        grouped_mm=grouped_mm,
        score_func="sigmoid" if sigmoid else "softmax",
        num_groups=int(getattr(gate, "num_group", 1) or 1) if sigmoid else 1,
        topk_group=int(getattr(gate, "topk_group", 1) or 1) if sigmoid else 1,
        routed_scaling_factor=float(getattr(gate, "routed_scaling_factor", 1.0) or 1.0),
    )
    shared_name = SUPPORTED_BLOCKS.get(kind, "shared_expert")
    shared = getattr(block, shared_name, None) if shared_name else None
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
        if bias is not None:
            assert moe.router.score_correction_bias is not None
            moe.router.score_correction_bias.copy_(bias)
    moe.load_experts(gate_up.detach(), down.detach())
    moe.hf_layout = {
        "block": kind,
        "shared": shared_name if shared is not None else None,
        "transposed": transposed,
    }
    gate_class: type[nn.Module] = type(block.get_submodule("gate"))
    moe.router_logits_relay = _relay_class(gate_class)()
    return moe


class _RouterLogitsRelay(nn.Module):
    """Hands the router logits of a converted layer to transformers' output recorder.

    transformers 5.x collects ``router_logits`` (for ``output_router_logits=True`` and its
    load-balancing loss) with forward hooks on the modules of its router class, taking output
    0. A converted layer has no such router, so each keeps one of these: a weightless module
    of a subclass of the HF router class (see :func:`_relay_class`), called with the layer's
    [T, E] logits, whose output 0 is those logits. Without an active recorder it does nothing.
    """

    def __init__(self) -> None:
        nn.Module.__init__(self)  # not the HF router's __init__: no weights, no config

    def forward(self, logits: Tensor) -> tuple[Tensor, None, None]:
        """[T, E] -> ([T, E], None, None), the HF routers' (logits, scores, indices) shape."""
        return logits, None, None


def _relay_class(router_class: type[nn.Module]) -> type[nn.Module]:
    """A relay class whose instances are instances of ``router_class`` (the HF router's)."""
    return type(f"{router_class.__name__}LogitsRelay", (_RouterLogitsRelay, router_class), {})


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _is_moe_block(module: nn.Module) -> bool:
    name = type(module).__name__
    looks_moe = name.endswith("SparseMoeBlock") or name.endswith("MoE")
    return looks_moe and hasattr(module, "gate") and hasattr(module, "experts")


def convert_hf_moe(
    model: nn.Module,
    *,
    dispatcher_factory: Callable[[int], Dispatcher] | None = None,
    grouped_mm: GroupedMM = "auto",
) -> list[int]:
    """Replace every HF sparse MoE block in ``model`` (in place) by an ExpertParallelMoE.

    A block is a module named ``*SparseMoeBlock`` or ``*MoE`` with ``gate`` and ``experts``;
    blocks outside :data:`SUPPORTED_BLOCKS` raise before anything is replaced. Its layer id is
    the decoder-layer index in its name (``...layers.<i>.mlp``).

    ``output_router_logits=True`` keeps working on the converted model: each layer hands its
    [T, E] router logits to transformers' recorder, so ``router_logits`` has transformers'
    shape and transformers' ``aux_loss`` (and the loss it adds under ``labels``) are computed
    as on the unconverted model. The package's own losses (:func:`collect_routing`,
    :func:`load_balancing_loss`) need no transformers.

    Args:
        model: a transformers model (or a pipeline part of one).
        dispatcher_factory: ``num_experts -> Dispatcher`` (default: one-process dispatch).
        grouped_mm: see :class:`MoEConfig`.

    Returns:
        The converted layer ids.
    """
    targets = [(name, module) for name, module in model.named_modules() if _is_moe_block(module)]
    unsupported = sorted({type(m).__name__ for _, m in targets} - set(SUPPORTED_BLOCKS))
    if unsupported:
        raise NotImplementedError(
            f"MoE blocks {unsupported} have no conversion; supported: {sorted(SUPPORTED_BLOCKS)}"
        )
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
        if new.router_logits_relay is not None:
            _hook_if_recorder_installed(model, new.router_logits_relay)
    return layer_ids


def _hook_if_recorder_installed(model: nn.Module, relay: nn.Module) -> None:
    """Give ``relay`` transformers' recording hook when the model already installed its hooks.

    transformers installs them lazily, on the first forward that records an output, and marks
    the model; modules added afterwards (by a conversion after such a forward) would be missed.
    """
    if not any(getattr(m, "_output_capturing_hooks_installed", False) for m in model.modules()):
        return
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook
    except ImportError as err:  # another transformers layout: no way to hook in afterwards
        raise RuntimeError(
            "this model recorded outputs (output_router_logits / output_hidden_states) before "
            "convert_hf_moe, and this transformers version offers no way to hook the converted "
            "layers into that recorder; convert the model before its first such forward"
        ) from err
    install_output_capuring_hook(relay, "router_logits", 0)


@torch.no_grad()
def hf_state_dict(
    model: nn.Module, state_dict: Mapping[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """The state dict of a converted model in the original HF layout (for ``from_pretrained``).

    Every :class:`ExpertParallelMoE` becomes its HF block again: ``router.weight`` ->
    ``gate.weight``, ``router.score_correction_bias`` -> ``gate.e_score_correction_bias``, the
    shared expert under its HF name, and the global experts. A layer that holds every expert
    (no expert parallelism) takes them from ``state_dict``, like every other entry; a layer
    whose experts are split over an expert-parallel group gathers them from that group's live
    shards (a collective: call it on every rank of that group, whatever ``state_dict`` holds).

    Why not always the live module: without expert parallelism the experts may be wrapped (an
    FSDP2 shard at ep=1 is a DTensor), and a DTensor handed on to a rank-0-only writer makes
    that writer run a collective no other rank joins: a hang.

    Args:
        model: the converted model (the keys of ``state_dict`` are relative to it).
        state_dict: full (unsharded) tensors to start from, e.g. gathered from FSDP2; None
            uses ``model.state_dict()``. A rank may pass {} (it writes nothing) and still joins
            the gathers.

    Returns:
        {HF key: tensor}, plain tensors only; load it with ``load_state_dict`` into the HF
        model class.

    Raises:
        TypeError: an entry (or split experts to gather) is a DTensor: pass full tensors,
            e.g. ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))``.
            Raised on every rank alike (the wrapping is the same on all).
    """
    source = dict(model.state_dict() if state_dict is None else state_dict)
    out: dict[str, Tensor] = {}
    moe_prefixes: list[tuple[str, ExpertParallelMoE]] = [
        (f"{name}." if name else "", m)
        for name, m in model.named_modules()
        if isinstance(m, ExpertParallelMoE)
    ]
    renamed: dict[str, str] = {}
    for prefix, moe in moe_prefixes:
        layout = moe.hf_layout or {}
        shared = layout.get("shared") or "shared_expert"
        for key in source:
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            if rest.startswith("experts."):
                renamed[key] = ""  # written below, in the HF storage layout
            elif rest == "router.weight":
                renamed[key] = prefix + "gate.weight"
            elif rest == "router.score_correction_bias":
                renamed[key] = prefix + "gate.e_score_correction_bias"
            elif rest.startswith("shared_expert."):
                renamed[key] = prefix + shared + rest[len("shared_expert") :]
        experts = _global_experts(prefix, moe, source)
        if experts is None:
            continue
        gate_up, down = experts
        if layout.get("transposed", False):
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[prefix + "experts.gate_up_proj"] = gate_up.contiguous()
        out[prefix + "experts.down_proj"] = down.contiguous()
    for key, value in source.items():
        new = renamed.get(key, key)
        if new:
            out[new] = value
    for key, value in out.items():
        _refuse_dtensor(key, value)
    return out


def _global_experts(
    prefix: str, moe: ExpertParallelMoE, source: Mapping[str, Tensor]
) -> tuple[Tensor, Tensor] | None:
    """[E, 2F, H] gate_up and [E, H, F] down of one layer, None where ``source`` has none.

    The decision depends on the layer alone, never on ``source`` (which may be empty on all
    ranks but one), so every rank of an expert-parallel group joins the same gathers.
    """
    if moe.dispatcher.num_local_experts == moe.config.num_experts:
        gate_up = source.get(prefix + "experts.gate_up_proj")
        down = source.get(prefix + "experts.down_proj")
        return None if gate_up is None or down is None else (gate_up, down)
    for name in ("gate_up_proj", "down_proj"):
        _refuse_dtensor(f"{prefix}experts.{name}", getattr(moe.experts, name))
    return moe.gather_experts()


def _refuse_dtensor(key: str, value: Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        raise TypeError(
            f"hf_state_dict got a DTensor for {key!r} ({value.placements}); it needs full "
            "tensors: pass state_dict=get_model_state_dict(model, options=StateDictOptions("
            "full_state_dict=True)) (torch.distributed.checkpoint.state_dict), gathered on "
            "every rank"
        )
