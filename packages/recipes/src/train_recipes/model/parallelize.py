"""Build the SFT model and distribute it, in torchtitan's order.

Tensor parallelism, activation checkpointing, compile, then data parallelism (DDP or FSDP2 on
the (dp, cp) gradient mesh; nothing with ``data_parallel: none``, a job of one rank).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from train_recipes.config.sft import SFTConfig
from train_recipes.data.energon_api import is_vlm
from train_recipes.model import moe
from train_recipes.model.activation_checkpointing import checkpoint_and_compile
from train_recipes.model.build import apply_lora, build_model
from train_recipes.model.loading import build_on_meta, load_sharded_safetensors
from train_recipes.model.patch_embed import use_linear_patch_embed
from train_recipes.model.tensor_parallel import apply_tensor_parallel
from train_recipes.model.vision_attention import use_varlen_vision_attention
from train_recipes.run.process_group import RankContext

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "build_parallel_model",
    "layers_trace_whole",
    "row_length_multiple",
    "uses_sharded_load",
]

logger = logging.getLogger(__name__)


def uses_sharded_load(config: SFTConfig) -> bool:
    """``model.sharded_load``, with None resolved: on for a model folder under FSDP2, no LoRA."""
    if config.model.sharded_load is not None:
        return config.model.sharded_load
    from moe_dispatch import SUPPORTED_MODEL_TYPES
    from train_recipes.model.moe import read_model_type

    return (
        config.model.path is not None
        and read_model_type(config.model.path)[0] not in SUPPORTED_MODEL_TYPES
        and config.parallel.data_parallel == "fsdp2"
        and not config.lora.enabled
    )


def layers_trace_whole(config: SFTConfig, *, moe_converted: bool) -> bool:
    """Whether dynamo traces each decoder layer of this run without a graph break.

    Packed rows and cp > 1 run cp-sharder's attention (excluded from compile), MoE layers the
    dispatcher's collectives and vision towers their own attention: each may break the graph,
    which decides how checkpointing nests with compile
    (:func:`train_recipes.model.activation_checkpointing.checkpoint_and_compile`).
    """
    return not (config.data.packing or config.parallel.cp > 1 or moe_converted or is_vlm(config))


def row_length_multiple(config: SFTConfig) -> int:
    """Give the multiple the loader pads every row (packed: every document) to.

    It is 2*cp (cp's head/tail chunks), times tp under sequence parallelism (each cp shard
    splits into tp).
    """
    parallel = config.parallel
    sequence_split = parallel.tp if parallel.tp > 1 and parallel.sequence_parallel else 1
    return 2 * parallel.cp * sequence_split


def build_parallel_model(
    config: SFTConfig,
    tokenizer: PreTrainedTokenizerBase,
    ctx: RankContext,
    *,
    on_phase: Callable[[str], None] | None = None,
) -> nn.Module:
    """The model of ``config`` on ``ctx.device``, sharded and wrapped for training.

    Call after seeding (a random-init model's weights come from the global RNG). With
    :func:`uses_sharded_load`, the model is built on the meta device, distributed, and then
    each rank reads its own slices of ``model.path``'s safetensors.

    Args:
        config: the validated recipe config.
        tokenizer: the run's tokenizer (a random-init model takes its vocabulary size).
        ctx: this rank's process groups and device.
        on_phase: called with "wrapping" once the model is built (the run's start-up clock).

    Returns:
        The DDP wrapper, or the model itself under FSDP2 (which works in place) and with
        ``data_parallel: none``.
    """
    from train_engine import apply_data_parallel

    if config.model.backend == "megatron":
        from train_recipes.megatron.recipe import build_megatron_model

        return build_megatron_model(config, tokenizer, ctx)
    sharded = uses_sharded_load(config)
    if sharded:
        assert config.model.path is not None  # validate_sft enforces it
        model = build_on_meta(
            config.model.path,
            dtype=getattr(torch, config.model.dtype),
            attn_implementation=config.model.attn_implementation,
            image_text=is_vlm(config),
        )
    else:
        model = apply_lora(build_model(config, tokenizer), config).to(ctx.device)
    if is_vlm(config):
        # Qwen2.5-VL-style towers: the patch embedding as a matmul (not cuDNN's Conv3d), and one
        # varlen call per vision block instead of one SDPA call per window (other towers, and an
        # explicitly chosen eager/flash attention, stay as they are).
        use_linear_patch_embed(model)
        if config.model.attn_implementation == "sdpa":
            use_varlen_vision_attention(model)
    model.train()
    if on_phase is not None:
        on_phase("wrapping")
    if ctx.tp_size > 1:
        model = apply_tensor_parallel(
            model, ctx.mesh["tp"], sequence_parallel=config.parallel.sequence_parallel
        )
    if sharded and moe.is_convertible(model):
        raise ValueError(
            "model.sharded_load does not support MoE models yet (their experts are converted "
            "from loaded weights); set model.sharded_load=false"
        )
    expert_shards = moe.prepare(model, ctx, config)  # MoE: converted, experts sharded over ep
    checkpoint_and_compile(
        model,
        checkpoint_every=config.model.activation_checkpointing_every
        if config.model.activation_checkpointing
        else None,
        compile_layers=config.model.compile,
        backend=config.model.compile_backend,
        traced_whole=layers_trace_whole(config, moe_converted=expert_shards is not None),
        memory_budget=config.model.compile_memory_budget,
    )
    if config.parallel.data_parallel != "none":
        model = apply_data_parallel(
            model,
            mesh=ctx.grad_mesh(),
            config=config.parallel.data_parallel_config(),
            gradient_accumulation_steps=config.train.gradient_accumulation_steps,
            expert_shards=expert_shards,
        )
    # "none" (one rank, validated): the model as is. A converted MoE model's experts are then
    # ordinary parameters: with one rank there is nothing to sync, and the Engine's clipping
    # norm over all parameters is the one over dense and expert parameters.
    if sharded:
        assert config.model.path is not None
        stats = load_sharded_safetensors(model, config.model.path, device=ctx.device)
        logger.info(
            "rank %d read %.1f of %.1f MB", ctx.rank, stats.bytes_read / 1e6, stats.file_bytes / 1e6
        )
    return model
