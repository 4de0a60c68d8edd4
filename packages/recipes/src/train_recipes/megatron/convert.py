"""Hugging Face Llama weights <-> megatron-core ``GPTModel`` weights, per tensor-parallel rank.

# V vocabulary, H hidden, F intermediate (MLP), Nq query heads, Ng key/value groups, D head dim

The mapping (layer i; "rows" = split along dim 0 over the tp ranks, "cols" = along dim 1):

| HF Llama | megatron-core GPTModel (local spec) | split |
|---|---|---|
| model.embed_tokens.weight [V, H] | embedding.word_embeddings.weight | rows |
| model.layers.i.input_layernorm.weight | decoder.layers.i.input_layernorm.weight | replicated |
| q_proj [Nq*D, H], k_proj, v_proj [Ng*D, H] | decoder.layers.i.self_attention.linear_qkv.weight | rows, per group |
| o_proj [H, Nq*D] | decoder.layers.i.self_attention.linear_proj.weight | cols |
| post_attention_layernorm.weight | decoder.layers.i.pre_mlp_layernorm.weight | replicated |
| gate_proj, up_proj [F, H] | decoder.layers.i.mlp.linear_fc1.weight | rows of each |
| down_proj [H, F] | decoder.layers.i.mlp.linear_fc2.weight | cols |
| model.norm.weight | decoder.final_layernorm.weight | replicated |
| lm_head.weight [V, H] (absent when tied) | output_layer.weight | rows |

The embedding and output rows are padded with zeros to a multiple of tp (Megatron splits the
vocabulary evenly; the recipe masks the padding's logits) and trimmed again on the way back.

Megatron's fused QKV weight holds, for each of the Ng groups in turn, the group's Nq / Ng query
heads, then its key head, then its value head; tp ranks take whole groups. Its fc1 weight is
[gate; up] *per rank*: rank r holds its slice of gate over its slice of up, because the GLU
splits each rank's local output in two halves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["hf_to_megatron", "load_hf_weights", "megatron_state_dict_full", "megatron_to_hf"]


def _dims(hf_config: PretrainedConfig) -> tuple[int, int, int]:
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, groups, head_dim


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, hf_config: PretrainedConfig) -> Tensor:
    """[Nq*D, H], [Ng*D, H], [Ng*D, H] -> Megatron's grouped [Ng * (Nq/Ng + 2) * D, H]."""
    heads, groups, head_dim = _dims(hf_config)
    per_group = heads // groups
    hidden = q.shape[1]
    q = q.reshape(groups, per_group * head_dim, hidden)
    k = k.reshape(groups, head_dim, hidden)
    v = v.reshape(groups, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def _split_qkv(qkv: Tensor, hf_config: PretrainedConfig) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of :func:`_fuse_qkv`."""
    heads, groups, head_dim = _dims(hf_config)
    per_group = heads // groups
    hidden = qkv.shape[1]
    grouped = qkv.reshape(groups, (per_group + 2) * head_dim, hidden)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, hidden).contiguous(),
        k.reshape(-1, hidden).contiguous(),
        v.reshape(-1, hidden).contiguous(),
    )


def hf_to_megatron(
    hf_state: dict[str, Tensor], hf_config: PretrainedConfig, *, tp: int, tp_rank: int
) -> dict[str, Tensor]:
    """This tp rank's megatron-core weights from a full HF Llama state dict.

    Args:
        hf_state: ``LlamaForCausalLM.state_dict()`` names and full tensors.
        hf_config: its config (head counts, layers, tied embeddings).
        tp: tensor-parallel size.
        tp_rank: this rank's index in the tp group.

    Raises:
        KeyError: an HF weight the mapping needs is missing (the message names it).
    """

    def get(name: str) -> Tensor:
        if name not in hf_state:
            raise KeyError(
                f"{name} is missing from the HF state dict; the megatron backend maps Llama-style "
                "checkpoints (see train_recipes.megatron.convert)"
            )
        return hf_state[name]

    def rows(t: Tensor) -> Tensor:
        return t.chunk(tp, dim=0)[tp_rank].contiguous()

    def cols(t: Tensor) -> Tensor:
        return t.chunk(tp, dim=1)[tp_rank].contiguous()

    def vocab_rows(t: Tensor) -> Tensor:
        padding = -(-t.shape[0] // tp) * tp - t.shape[0]
        if padding:
            t = torch.cat([t, t.new_zeros(padding, t.shape[1])])
        return rows(t)

    out: dict[str, Tensor] = {
        "embedding.word_embeddings.weight": vocab_rows(get("model.embed_tokens.weight"))
    }
    for i in range(hf_config.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = _fuse_qkv(
            get(hf + "self_attn.q_proj.weight"),
            get(hf + "self_attn.k_proj.weight"),
            get(hf + "self_attn.v_proj.weight"),
            hf_config,
        )
        gate, up = get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")
        out[mg + "input_layernorm.weight"] = get(hf + "input_layernorm.weight").clone()
        out[mg + "self_attention.linear_qkv.weight"] = rows(qkv)
        out[mg + "self_attention.linear_proj.weight"] = cols(get(hf + "self_attn.o_proj.weight"))
        out[mg + "pre_mlp_layernorm.weight"] = get(hf + "post_attention_layernorm.weight").clone()
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([rows(gate), rows(up)])
        out[mg + "mlp.linear_fc2.weight"] = cols(get(hf + "mlp.down_proj.weight"))
    out["decoder.final_layernorm.weight"] = get("model.norm.weight").clone()
    if not getattr(hf_config, "tie_word_embeddings", False):
        out["output_layer.weight"] = vocab_rows(get("lm_head.weight"))
    return out


def load_hf_weights(
    model: nn.Module, hf_state: dict[str, Tensor], hf_config: PretrainedConfig
) -> None:
    """Copy a full HF Llama state dict into this rank's ``GPTModel`` parameters.

    Raises:
        ValueError: a parameter with no HF source, or an HF-derived tensor of another shape.
    """
    from megatron.core import parallel_state

    local = hf_to_megatron(
        hf_state,
        hf_config,
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
    )
    params = dict(model.named_parameters())
    unmapped = sorted(set(params) - set(local))
    if unmapped:
        raise ValueError(f"GPTModel parameters without an HF source: {unmapped}")
    with torch.no_grad():
        for name, tensor in local.items():
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{name}: the HF weights give shape {tuple(tensor.shape)}, the GPTModel has "
                    f"{tuple(param.shape)}; the HF config and the model disagree"
                )
            param.copy_(tensor.to(param.dtype))


def megatron_state_dict_full(model: nn.Module, hf_config: PretrainedConfig) -> dict[str, Tensor]:
    """Every ``GPTModel`` weight as the full (tp = 1) tensor, on every tp rank.

    One all-gather per sharded weight over Megatron's tensor-parallel group. fc1's per-rank
    [gate; up] halves are regrouped, so the result is the layout of a tp = 1 model.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    full: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        t = param.detach()
        if tp == 1 or not getattr(param, "tensor_model_parallel", False):
            full[name] = t.clone()
            continue
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=group)
        if name.endswith("mlp.linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in parts]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            full[name] = torch.cat(parts, dim=int(getattr(param, "partition_dim", 0)))
    return full


def megatron_to_hf(full: dict[str, Tensor], hf_config: PretrainedConfig) -> dict[str, Tensor]:
    """HF Llama names and tensors from full (tp = 1) ``GPTModel`` weights (the inverse map)."""
    vocab = hf_config.vocab_size  # the padding rows (tp does not divide V) are dropped
    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:vocab]
    }
    for i in range(hf_config.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = _split_qkv(full[mg + "self_attention.linear_qkv.weight"], hf_config)
        gate, up = full[mg + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[hf + "input_layernorm.weight"] = full[mg + "input_layernorm.weight"]
        out[hf + "self_attn.q_proj.weight"] = q
        out[hf + "self_attn.k_proj.weight"] = k
        out[hf + "self_attn.v_proj.weight"] = v
        out[hf + "self_attn.o_proj.weight"] = full[mg + "self_attention.linear_proj.weight"]
        out[hf + "post_attention_layernorm.weight"] = full[mg + "pre_mlp_layernorm.weight"]
        out[hf + "mlp.gate_proj.weight"] = gate.contiguous()
        out[hf + "mlp.up_proj.weight"] = up.contiguous()
        out[hf + "mlp.down_proj.weight"] = full[mg + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = full["decoder.final_layernorm.weight"]
    if getattr(hf_config, "tie_word_embeddings", False):
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    else:
        out["lm_head.weight"] = full["output_layer.weight"][:vocab]
    return out
