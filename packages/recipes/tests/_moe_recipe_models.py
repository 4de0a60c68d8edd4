"""Tiny random transformers MoE models saved with save_pretrained, with the demo tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_tiny_moe(kind: str, directory: Path, *, seed: int = 0) -> Path:
    """Write a 2-layer top-2 ``kind`` model ("qwen3_moe", "mixtral": 4 experts; "deepseek_v3":
    8 experts in 4 groups, a shared expert, MoE in layer 1) to ``directory``."""
    import transformers

    from train_recipes.demo import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 256,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    config: Any
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            **common,
        )
        cls: Any = transformers.Qwen3MoeForCausalLM
    elif kind == "mixtral":
        config = transformers.MixtralConfig(
            intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **common
        )
        cls = transformers.MixtralForCausalLM
    elif kind == "deepseek_v3":
        for key in ("num_key_value_heads", "head_dim"):
            common.pop(key)
        config = transformers.DeepseekV3Config(
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_key_value_heads=4,
            **common,
        )
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
