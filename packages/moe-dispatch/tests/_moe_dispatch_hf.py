"""Tiny Hugging Face sparse MoE blocks with seeded random weights (test-only transformers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def build_block(kind: str, *, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A small HF MoE block of ``kind`` ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")."""
    common = {"hidden_size": 16, "num_experts_per_tok": 2, "hidden_act": "silu"}
    block: nn.Module
    if kind == "mixtral":
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        block = MixtralSparseMoeBlock(
            MixtralConfig(intermediate_size=24, num_local_experts=8, **common)
        )
    elif kind == "qwen2_moe":
        from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        block = Qwen2MoeSparseMoeBlock(
            Qwen2MoeConfig(
                moe_intermediate_size=24,
                shared_expert_intermediate_size=20,
                num_experts=8,
                norm_topk_prob=False,
                **common,
            )
        )
    elif kind == "qwen3_moe":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(moe_intermediate_size=24, num_experts=8, norm_topk_prob=True, **common)
        )
    elif kind == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        block = DeepseekV3MoE(deepseek_v3_config(hidden_size=16, moe_intermediate_size=24))
    else:
        raise ValueError(kind)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for b in block.buffers():  # DeepSeek's score-correction bias
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return block.to(dtype).eval()


def deepseek_v3_config(**overrides: Any) -> Any:
    """A tiny DeepSeek-V3 config: 8 experts in 4 groups, 2 kept groups, top-2, 1 shared."""
    from transformers import DeepseekV3Config

    fields: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "moe_intermediate_size": 12,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 4,
        "max_position_embeddings": 32,
        "hidden_act": "silu",
    }
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def tiny_causal_lm(kind: str, *, seed: int) -> nn.Module:
    """A tiny random transformers causal LM of ``kind`` with 2 layers (MoE in at least one)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32,
    }
    config: Any
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            intermediate_size=24,
            moe_intermediate_size=12,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            **common,
        )
        cls: Any = transformers.Qwen3MoeForCausalLM
    elif kind == "mixtral":
        config = transformers.MixtralConfig(
            intermediate_size=12,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            **common,
        )
        cls = transformers.MixtralForCausalLM
    elif kind == "deepseek_v3":
        config = deepseek_v3_config()
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(kind)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.eval()
