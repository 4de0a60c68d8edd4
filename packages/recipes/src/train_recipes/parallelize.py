"""Build the SFT model and distribute it, in torchtitan's order: tensor parallelism, activation
checkpointing, compile, then data parallelism (DDP or FSDP2 on the (dp, cp) gradient mesh)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from train_recipes._dist import RankContext, engine_dp_config
from train_recipes.checkpointing import apply_activation_checkpointing
from train_recipes.config import SFTConfig
from train_recipes.modeling import apply_lora, build_model, compile_decoder_layers
from train_recipes.tensor_parallel import apply_tensor_parallel

__all__ = ["build_parallel_model"]

logger = logging.getLogger(__name__)


def build_parallel_model(config: SFTConfig, tokenizer: Any, ctx: RankContext) -> nn.Module:
    """The model of ``config`` on ``ctx.device``, sharded and wrapped for training.

    Call after seeding (a random-init model's weights come from the global RNG).

    Returns:
        The DDP wrapper, or the model itself under FSDP2 (which works in place).
    """
    from train_engine import apply_data_parallel

    model = apply_lora(build_model(config, tokenizer), config).to(ctx.device)
    model.train()
    if ctx.tp_size > 1:
        model = apply_tensor_parallel(model, ctx.mesh["tp"])
    if config.model.activation_checkpointing:
        apply_activation_checkpointing(model, every=config.model.activation_checkpointing_every)
    if config.model.compile:
        compile_decoder_layers(model)
    return apply_data_parallel(
        model,
        mesh=ctx.grad_mesh(),
        config=engine_dp_config(config.parallel),
        gradient_accumulation_steps=config.train.gradient_accumulation_steps,
    )
