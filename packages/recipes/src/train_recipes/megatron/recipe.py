"""The SFT recipe's hooks for ``model.backend: megatron``: build, evaluate and export.

The model is built as the HF backend builds it (``model.path`` loaded, or the random-init tiny
Llama from the seeded global RNG), then its weights are converted into a megatron-core
``GPTModel`` sharded over ``parallel.tp``: both backends start from the same weights. For the
held-out exact match and the Hugging Face export, the GPTModel's weights are converted back
into an HF model (gathered over tp), so generation and the export are the HF backend's own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from train_recipes.config.sft import SFTConfig
    from train_recipes.run.process_group import RankContext

__all__ = ["build_megatron_model", "hf_config", "hf_copy", "is_megatron_model"]

logger = logging.getLogger(__name__)

# Where the HF config travels with the GPTModel (the export and the evaluation rebuild from it).
_HF_CONFIG = "_train_recipes_hf_config"


def _innermost(model: object) -> object:
    """The module under the Engine / DDP wrappers (each keeps it in ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def is_megatron_model(model: object) -> bool:
    """Whether ``model`` is a megatron-core model (or wraps one in an Engine / DDP).

    Imports nothing.
    """
    return type(_innermost(model)).__module__.startswith("megatron.core")


def hf_config(model: object) -> PretrainedConfig:
    """The transformers config the GPTModel inside ``model`` was built from."""
    return getattr(_innermost(model), _HF_CONFIG)


def build_megatron_model(
    config: SFTConfig, tokenizer: PreTrainedTokenizerBase, ctx: RankContext
) -> nn.Module:
    """The recipe's model as a megatron-core GPTModel on ``ctx.device``, wrapped in DDP.

    Call after seeding, as for the HF backend (the tiny model's weights come from the global
    RNG), on every rank.

    Args:
        config: the validated ``SFTConfig`` (``model.backend == "megatron"``).
        tokenizer: the run's tokenizer (the tiny model's vocabulary size).
        ctx: the rank's ``RankContext`` (its mesh has tp innermost, as Megatron's groups).

    Returns:
        The DDP wrapper for the Engine (see ``training.wrap_data_parallel``).
    """
    from megatron.core import parallel_state

    from train_recipes.megatron.convert import load_hf_weights
    from train_recipes.megatron.model import build_gpt_model, init_megatron_parallel
    from train_recipes.megatron.training import wrap_data_parallel
    from train_recipes.model.build import build_model

    init_megatron_parallel(ctx.tp_size, seed=config.train.seed)
    hf = cast("PreTrainedModel", build_model(config, tokenizer))  # the HF backend's model
    dtype = next(hf.parameters()).dtype
    gpt = build_gpt_model(hf.config, tp=ctx.tp_size, dtype=dtype)
    load_hf_weights(gpt, hf.state_dict(), hf.config)
    setattr(gpt, _HF_CONFIG, hf.config)
    del hf
    gpt = gpt.to(ctx.device)
    # SegmentCausalAttention and RoPE read no global state; the model trains in train mode.
    gpt.train()
    logger.info(
        "megatron-core GPTModel: tp=%d dp=%d, %.1fM parameters on this rank",
        ctx.tp_size,
        parallel_state.get_data_parallel_world_size(),
        sum(p.numel() for p in gpt.parameters()) / 1e6,
    )
    return wrap_data_parallel(gpt, dp_group=parallel_state.get_data_parallel_group())


@torch.no_grad()
def hf_copy(model: object, *, device: torch.device) -> nn.Module:
    """The GPTModel's current weights as a transformers model on ``device``, in eval mode.

    Collective over tp: every rank gets the full model.
    """
    from transformers import AutoModelForCausalLM

    from train_recipes.megatron.convert import megatron_state_dict_full, megatron_to_hf

    gpt = cast(nn.Module, _innermost(model))  # the GPTModel
    config = hf_config(gpt)
    state = megatron_to_hf(megatron_state_dict_full(gpt, config), config)
    dtype = next(gpt.parameters()).dtype
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf.load_state_dict(state)
    return hf.to(device).eval()
