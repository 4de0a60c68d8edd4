"""Whole-model tensor parallelism (Megatron-style) for transformers decoder models, with DTensor.

Per decoder layer: q/k/v and gate/up projections are column-parallel (each rank holds a slice
of the heads and of the MLP width), o and down projections row-parallel, so a layer costs two
collectives on the way in and two on the way out. The input embedding is vocabulary-parallel
(rows sharded, masked lookup, all-reduce) and the output projection column-parallel over the
vocabulary: its logits stay a ``Shard(-1)`` DTensor, which vocab-parallel's losses consume
without gathering V.

Sequence parallelism (``sequence_parallel=True``, Megatron-SP as in torchtitan): between the
attention and MLP blocks the residual stream is sharded over the sequence (``Shard(1)``,
[B, S/tp, H] per rank), the RMSNorms run on each rank's tokens (``SequenceParallel``: their
weights are replicated DTensors, so each weight's gradient is summed over the ranks' tokens),
the attention / MLP inputs are all-gathered over the sequence and the o / down projections
reduce-scatter instead of all-reducing. The same bytes move as without it, but norms, residuals
and the checkpointed layer inputs take 1/tp of the activation memory. The sequence is split at
the first decoder layer's input, not at the embedding, so transformers' own code before the
layers (masks, position ids and rotary tables from the full length, a VLM's image-feature
scatter into the embeddings, cp-sharder's ``inputs_embeds``) runs on the whole sequence
unchanged; the output projection gathers it back. Every rank's sequence length must be a
multiple of tp (the recipe pads its rows so).

Without it, activations between layers are plain replicated tensors and the norms replicated.

Inside attention, transformers reshapes q/k/v with ``view(*input_shape, -1, head_dim)``: the
local head count follows from the sharded projection width, and the grouped-query ratio (q
heads per kv head) is the same on every rank when both head counts divide tp.

Plans are chosen from the model class (:data:`SUPPORTED_ARCHITECTURES`). Adding a model whose
blocks use the same projection and norm names takes one entry in ``_PLANS``; others need their
own plan.

# B batch, S sequence, H hidden, V vocabulary
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor, nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TPPlan",
    "apply_tensor_parallel",
    "plan_for",
    "tp_head_counts",
]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class TPPlan:
    """Where a model's parallelisable parts live, as module paths.

    Attributes:
        text_model: the module holding ``embed_tokens``, ``layers`` and the final norm.
        lm_head: the output projection, relative to the top model.
        colwise: linears inside a decoder layer split over their output features.
        rowwise: linears inside a decoder layer split over their input features.
        head_norms: norms applied to each head of a column-parallel output ([B, S, heads,
            head_dim], e.g. Qwen3's q_norm/k_norm): their weights become replicated DTensors
            so each weight's gradient is summed over the ranks' heads.
        replicated: parameters of a decoder layer that stay plain tensors without sequence
            parallelism (they only see replicated activations, so every rank computes the
            whole gradient).
        norms: a decoder layer's norms on the residual stream (sequence-parallel under
            ``sequence_parallel``).
        attention: a decoder layer's attention module (its ``hidden_states`` keyword input,
            the normed residual stream, is gathered over the sequence under
            ``sequence_parallel``).
        mlp: a decoder layer's MLP module (its first positional input, likewise).
        final_norm: the norm after the last layer, relative to ``text_model``.
    """

    text_model: str
    lm_head: str = "lm_head"
    colwise: tuple[str, ...] = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    )
    rowwise: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    head_norms: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ("input_layernorm.weight", "post_attention_layernorm.weight")
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    attention: str = "self_attn"
    mlp: str = "mlp"
    final_norm: str = "norm"


_DENSE = TPPlan(text_model="model")
_PLANS: Mapping[str, TPPlan] = {
    "LlamaForCausalLM": _DENSE,
    "Qwen2ForCausalLM": _DENSE,
    "Qwen3ForCausalLM": TPPlan(
        text_model="model", head_norms=("self_attn.q_norm", "self_attn.k_norm")
    ),
    "Qwen2_5_VLForConditionalGeneration": TPPlan(text_model="model.language_model"),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_PLANS)


def plan_for(architecture: str) -> TPPlan:
    """The plan of a transformers model class name (``config.architectures[0]``).

    Raises:
        ValueError: no plan for this class, naming the supported ones and how to add one.
    """
    plan = _PLANS.get(architecture)
    if plan is None:
        raise ValueError(
            f"tensor parallelism has no plan for {architecture}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. A model whose decoder layers have "
            "self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj gets one by adding its class "
            "to train_recipes.model.tensor_parallel._PLANS (TPPlan(text_model=<path of embed_tokens "
            "and layers>)); otherwise use parallel.tp=1"
        )
    return plan


def tp_head_counts(hf_config: Mapping[str, Any]) -> tuple[int, int]:
    """(query heads, key/value heads) from a config.json mapping (a VLM's ``text_config``)."""
    text = hf_config.get("text_config") or hf_config
    heads = int(text.get("num_attention_heads") or hf_config["num_attention_heads"])
    kv = text.get("num_key_value_heads") or hf_config.get("num_key_value_heads") or heads
    return heads, int(kv)


def _get(model: nn.Module, path: str) -> nn.Module:
    module: nn.Module = model.get_submodule(path) if path else model
    return module


def _check_no_partial_gradients(layer: nn.Module, replicated: set[str]) -> None:
    """Refuse plain parameters in the sharded region that the plan does not declare replicated.

    Such a parameter would get only this rank's share of its gradient (silently wrong training).
    """
    from torch.distributed.tensor import DTensor

    stray = [
        name
        for name, param in layer.named_parameters()
        if not isinstance(param, DTensor) and name not in replicated
    ]
    if stray:
        raise ValueError(
            f"the tensor-parallel plan for {type(layer).__name__} leaves {stray} as plain "
            "replicated parameters; inside a sharded attention or MLP their gradients would be "
            "partial. Add them to the plan (TPPlan.head_norms for per-head norms, .colwise/"
            ".rowwise for linears) in train_recipes.model.tensor_parallel"
        )


def _check_sequence_divides(
    tp: int,
) -> Callable[[nn.Module, tuple[object, ...], Mapping[str, object]], None]:
    """Build a pre-hook for the first decoder layer that refuses lengths tp does not divide.

    Sequence parallelism splits [B, S, H] into tp equal parts (DTensor's ``from_local`` assumes
    even shards).
    """

    def check(module: nn.Module, args: tuple[object, ...], kwargs: Mapping[str, object]) -> None:
        hidden = cast("Tensor", args[0] if args else kwargs["hidden_states"])  # [B, S, H]
        if hidden.shape[1] % tp:
            raise ValueError(
                f"sequence parallelism over tp={tp} needs the sequence length divisible by tp, "
                f"got {hidden.shape[1]} tokens; pad the rows to a multiple of {tp} (the recipe "
                "does: energon-sft pad_to_multiple_of) or set parallel.sequence_parallel=false"
            )

    return check


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False
) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` in place; call before FSDP2 (and after compile / AC).

    Works on a model on the meta device too (``parallelize_module`` only re-wraps parameters),
    so a sharded load can fill in each rank's slices afterwards. A tied output projection stays
    tied: embedding and output projection are both sharded over V on dim 0, and the output
    projection is pointed back at the embedding's DTensor.

    Args:
        model: a transformers model of a class in :data:`SUPPORTED_ARCHITECTURES`, or a peft
            LoRA model of one (adapters on the planned linears are sharded with them).
        tp_mesh: the 1-D tensor-parallel mesh (``RankContext.mesh["tp"]``).
        sequence_parallel: shard the residual stream and the norms over the sequence between
            the blocks (see the module docstring); the sequence length at the decoder layers
            must then be a multiple of tp.

    Returns:
        ``model``, whose forward returns logits [B, S, V] as a DTensor ``Shard(-1)``.

    Raises:
        ValueError: an unsupported architecture, or head counts that tp does not divide.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # A peft model: its base model's modules (LoRA layers replaced some linears in place).
    wrapper: Any = model
    base: Any = wrapper.get_base_model() if hasattr(wrapper, "get_base_model") else model
    plan = plan_for(type(base).__name__)
    tp = tp_mesh.size()
    config: Any = base.config
    text_config = getattr(config, "text_config", None) or config
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"tensor parallelism over tp={tp} needs the query heads ({heads}) and key/value "
            f"heads ({kv_heads}) divisible by tp; pick a tp that divides both"
        )
    text = _get(base, plan.text_model)
    embed = text.get_submodule("embed_tokens")
    head = _get(base, plan.lm_head)
    tied = head.weight is embed.weight
    # SequenceParallel re-creates parameters as trainable; LoRA's frozen norms must stay frozen.
    frozen = {name for name, param in base.named_parameters() if not param.requires_grad}
    # Sequence parallel: row-parallel outputs are reduce-scattered over the sequence (Shard(1),
    # returned as the local [B, S/tp, H]) instead of all-reduced.
    rowwise_out = Shard(1) if sequence_parallel else Replicate()

    layers: Any = text.get_submodule("layers")
    for index, layer in enumerate(layers):
        layer_plan: dict[str, Any] = {}
        replicated = set() if sequence_parallel else set(plan.replicated)
        for names, style, plain_side in (
            (plan.colwise, ColwiseParallel, "lora_A"),
            (plan.rowwise, RowwiseParallel, "lora_B"),
        ):
            kwargs: dict[str, Any] = (
                {"output_layouts": rowwise_out} if style is RowwiseParallel else {}
            )
            for name in names:
                module = layer.get_submodule(name)
                if not hasattr(module, "base_layer"):
                    layer_plan[name] = style(**kwargs)
                    continue
                # A peft LoRA layer: y = base(x) + B(A(x)) * scale. Column-parallel: base and B
                # split the output features, A (in -> r) stays whole and gets the complete
                # gradient (B's input gradient is all-reduced). Row-parallel: base and A split
                # the input features, B (r -> out) sees the all-reduced A(x) and stays whole;
                # under sequence parallelism A(x) is reduce-scattered like base(x) and B, seeing
                # only this rank's tokens, becomes a replicated DTensor (gradient summed).
                layer_plan[f"{name}.base_layer"] = style(**kwargs)
                sharded_side = "lora_B" if plain_side == "lora_A" else "lora_A"
                for adapter in getattr(module, sharded_side):
                    layer_plan[f"{name}.{sharded_side}.{adapter}"] = style(**kwargs)
                plain = getattr(module, plain_side)
                if sequence_parallel and style is RowwiseParallel:
                    for adapter in plain:
                        layer_plan[f"{name}.{plain_side}.{adapter}"] = SequenceParallel(
                            use_local_output=True
                        )
                    continue
                replicated |= {
                    f"{name}.{plain_side}.{adapter}.{p}"
                    for adapter, sub in plain.items()
                    for p, _ in sub.named_parameters()
                }
        for name in plan.head_norms:
            # The input [B, S, heads_local, head_dim] is sharded over heads (dim 2).
            layer_plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if sequence_parallel:
            for name in plan.norms:  # [B, S/tp, H] in, a Shard(1) DTensor out
                layer_plan[name] = SequenceParallel()
            # The normed stream is gathered over the sequence into each block; transformers
            # passes attention its input by keyword and the MLP its input by position.
            layer_plan[plan.attention] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            )
            layer_plan[plan.mlp] = PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            )
            if index == 0:
                # The whole-sequence embeddings (after any image-feature merge) split here;
                # the check runs first, on the whole sequence.
                layer.register_forward_pre_hook(_check_sequence_divides(tp), with_kwargs=True)
                parallelize_module(
                    layer,
                    tp_mesh,
                    PrepareModuleInput(
                        input_layouts=(Replicate(),),
                        desired_input_layouts=(Shard(1),),
                        use_local_output=True,
                    ),
                )
        parallelize_module(layer, tp_mesh, layer_plan)
        _check_no_partial_gradients(layer, replicated)
    parallelize_module(
        embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    )
    if sequence_parallel:
        parallelize_module(
            text.get_submodule(plan.final_norm), tp_mesh, SequenceParallel(use_local_output=True)
        )
    # Logits stay sharded over V (a DTensor): vocab-parallel's loss reads them as they are.
    parallelize_module(
        head,
        tp_mesh,
        ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1),
            use_local_output=False,
        ),
    )
    if tied:
        head.weight = embed.weight
    for name, param in base.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    logger.info(
        "tensor parallel over tp=%d%s: %d layers, embedding and output projection over V%s",
        tp,
        " with sequence-parallel norms" if sequence_parallel else "",
        len(layers),
        " (tied)" if tied else "",
    )
    return model
