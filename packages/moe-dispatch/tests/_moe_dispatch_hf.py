"""Tiny Hugging Face sparse MoE blocks with seeded random weights (test-only transformers)."""

from __future__ import annotations

import torch
from torch import nn


def build_block(kind: str, *, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A small ``*SparseMoeBlock`` of ``kind`` ("mixtral", "qwen2_moe", "qwen3_moe")."""
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
    else:
        raise ValueError(kind)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block.to(dtype).eval()
