"""The parts of an SFT run, built in order by :meth:`SFTRecipe.setup`, each with a typed result.

# B batch, S sequence
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from train_recipes.data import energon_api as data_api
from train_recipes.data.colocated import ColocatedLoader, replica_loader
from train_recipes.data.demo import sft_data_paths
from train_recipes.data.energon_api import is_vlm
from train_recipes.data.processors import load_processor, tokenizer_of
from train_recipes.loss.token_loss import TokenSumLoss
from train_recipes.model.build import unwrap
from train_recipes.model.parallelize import row_length_multiple
from train_recipes.run import runtime
from train_recipes.run.folder import publish_dir, staging_dir
from train_recipes.run.runtime import OptimizerChoice, build_optimizer

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from cp_sharder import ContextParallelSharder
    from energon_sft import SFTTaskEncoder
    from train_engine import Engine
    from train_recipes.config.sft import SFTConfig
    from train_recipes.run.process_group import RankContext

__all__ = [
    "SFTData",
    "SFTTraining",
    "build_data",
    "build_loader",
    "build_training",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class SFTData:
    """The run's data sources and the processor that encodes them.

    Attributes:
        dataset_path: the Energon dataset (``data.path`` or the demo's, written by rank 0).
        eval_path: the held-out chats (JSONL), None when there are none.
        processor: the tokenizer, or a VLM's processor.
        pad_token_id: the tokenizer's padding id (cp-sharder pads shards with it).
    """

    dataset_path: Path
    eval_path: Path | None
    processor: Any  # a transformers tokenizer or processor: they share no base class
    pad_token_id: int


def build_data(config: SFTConfig, out_dir: Path, *, is_main: bool) -> SFTData:
    """The data paths and the processor; rank 0 saves the tokenizer into the run folder.

    The tokenizer is written whole (staged, then moved in): ``train-recipes export`` reads it.
    """
    dataset_path, eval_path = sft_data_paths(config, out_dir, is_main=is_main)
    processor = load_processor(config)
    if is_main:
        processor.save_pretrained(staging := staging_dir(out_dir / "tokenizer"))
        publish_dir(staging, out_dir / "tokenizer")
    return SFTData(
        dataset_path=dataset_path,
        eval_path=eval_path,
        processor=processor,
        pad_token_id=int(tokenizer_of(processor).pad_token_id),
    )


@dataclass(kw_only=True, slots=True, frozen=True)
class SFTTraining:
    """What trains the distributed model: the Engine, its schedule and the loss path.

    Attributes:
        engine: the Engine around the model and its AdamW.
        scheduler: the learning-rate schedule the Engine steps.
        optimizer_choice: which AdamW was built and the start-up line that says why.
        sharder: cp-sharder's sharder for packed rows or cp > 1 (None otherwise, and for the
            megatron backend, whose attention reads the packed layout itself).
        loss: the run's token-sum loss path, resolved once.
    """

    engine: Engine
    scheduler: LRScheduler
    optimizer_choice: OptimizerChoice
    sharder: ContextParallelSharder | None
    loss: TokenSumLoss


def build_training(
    config: SFTConfig, ctx: RankContext, model: torch.nn.Module, *, pad_token_id: int
) -> SFTTraining:
    """The optimizer, its schedule, the Engine, the sharder and the loss path of ``model``."""
    from train_engine import Engine

    train = config.train
    # Resolved once: the same choice builds the optimizer and is printed at the start.
    choice = runtime.choose_optimizer(model, config.optim, device=ctx.device)
    optimizer, scheduler = build_optimizer(
        model, config.optim, device=ctx.device, total_steps=train.steps, choice=choice
    )
    engine = Engine(
        model,
        optimizer,
        scheduler,
        max_grad_norm=config.optim.max_grad_norm,
        nonfinite=config.optim.nonfinite,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        # Token counts are per data-parallel replica: a replica's cp ranks count the same.
        dp_group=ctx.mesh["dp"].get_group(),
    )
    sharder = None
    # Packed rows take cp-sharder's variable-length attention, at cp=1 as well (the megatron
    # backend's own attention reads the packed layout from PackedSeqParams instead).
    if config.model.backend != "megatron" and (ctx.cp_size > 1 or config.data.packing):
        from cp_sharder import ContextParallelSharder

        sharder = ContextParallelSharder(
            unwrap(model), ctx.mesh["cp"], padding_token_id=pad_token_id
        )
    loss = TokenSumLoss.for_model(
        engine,
        sharder=sharder,
        vlm=is_vlm(config),
        chunk_tokens=config.model.fused_loss_chunk_tokens,
        trained_only=config.model.fused_loss_trained_only,
    )
    return SFTTraining(
        engine=engine, scheduler=scheduler, optimizer_choice=choice, sharder=sharder, loss=loss
    )


def build_loader(
    config: SFTConfig, ctx: RankContext, data: SFTData
) -> tuple[SFTTaskEncoder, ColocatedLoader]:
    """energon-sft's encoder, and this replica's loader.

    One loader per replica, on its first rank; its cp/tp peers receive the batches.
    """
    encoder = data_api.build_encoder(
        data.processor,
        model_family=config.data.model_family,
        max_length=config.data.max_length,
        train_on=config.data.train_on,
        pad_to_multiple_of=row_length_multiple(config),
        packing=config.data.packing,
        overlong=config.data.overlong,
    )
    return encoder, replica_loader(config, ctx, data.dataset_path, encoder=encoder)
