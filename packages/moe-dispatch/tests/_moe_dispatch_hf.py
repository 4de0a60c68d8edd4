"""Tiny Hugging Face sparse MoE blocks with seeded random weights (test-only transformers)."""

from __future__ import annotations

import torch
from torch import nn

from train_testing.tiny_hf import tiny_config, tiny_model


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

        block = DeepseekV3MoE(tiny_config(kind, hidden_size=16, moe_intermediate_size=24))
    else:
        raise ValueError(kind)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for b in block.buffers():  # DeepSeek's score-correction bias
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return block.to(dtype).eval()


def tiny_causal_lm(kind: str, *, seed: int) -> nn.Module:
    """A tiny random transformers causal LM of ``kind`` with 2 layers (MoE in at least one).

    train_testing's tiny sizes with a 64-token vocabulary, eager attention, and every weight
    redrawn from N(0, 0.2) (DeepSeek's score-correction bias from N(0, 0.1)) so that routing
    differences show in the logits.
    """
    model = tiny_model(kind, seed=seed, attn_implementation="eager", vocab_size=64, init_std=0.2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.eval()
