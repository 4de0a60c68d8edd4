"""Tiny random transformers MoE models saved with save_pretrained, with the demo tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from train_testing.tiny_hf import save_tiny, tiny_model

# Per family, what differs from train_testing's tiny sizes (hidden 32, 4 heads, head_dim 8).
_FIELDS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"intermediate_size": 48, "norm_topk_prob": True},
    "mixtral": {"intermediate_size": 16},
    "deepseek_v3": {
        "intermediate_size": 48,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
    },
}


def save_tiny_moe(kind: str, directory: Path, *, seed: int = 0) -> Path:
    """Write a 2-layer top-2 ``kind`` model ("qwen3_moe", "mixtral": 4 experts; "deepseek_v3":
    8 experts in 4 groups, a shared expert, MoE in layer 1) to ``directory``."""
    from train_recipes.data.demo import build_char_tokenizer

    if kind not in _FIELDS:
        raise ValueError(kind)
    tokenizer = build_char_tokenizer()
    untied_special = {
        "tie_word_embeddings": False,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    fields = {"vocab_size": len(tokenizer), **untied_special, **_FIELDS[kind]}
    model = tiny_model(kind, seed=seed, **fields)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return save_tiny(model, directory, tokenizer=tokenizer)
