"""The SFT run's held-out measurements: greedy exact match and the held-out loss.

Both read the eval split (``data.eval_path`` or the demo's held-out questions), never the
training stream; both are collective (every rank calls them together).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from energon_sft import SFTTaskEncoder
    from train_recipes.data.processors import Processor

from train_recipes.config.sft import SFTConfig
from train_recipes.data.energon_api import ModelBatch
from train_recipes.evaluation.exact_match import exact_match_accuracy
from train_recipes.evaluation.heldout_loss import LossSum, held_out_batches, held_out_loss
from train_recipes.run.process_group import RankContext

__all__ = ["SFTEvaluation"]


class SFTEvaluation:
    """The held-out rows and batches of one rank, read and encoded once.

    Args:
        config: the run's config (``train.eval_samples``, ``eval_every``, ``eval_loss_samples``,
            ``eval_max_new_tokens``, ``data.micro_batch_size``).
        ctx: this rank's place in the mesh.
        eval_path: the held-out chat JSONL, or None (no evaluation).
        encoder: the training data's energon-sft encoder (the held-out loss encodes with it).
        processor: the tokenizer or processor (exact match decodes with it).
        vlm: the image-text path.
        loss_sum: the training loss's token sum of one (device batch, host batch).
    """

    def __init__(
        self,
        config: SFTConfig,
        ctx: RankContext,
        *,
        eval_path: Path | None,
        encoder: SFTTaskEncoder,
        processor: Processor,
        vlm: bool,
        loss_sum: LossSum,
    ) -> None:
        from train_recipes.data.demo import read_jsonl

        train = config.train
        self._ctx, self._processor, self._loss_sum = ctx, processor, loss_sum
        self._max_new_tokens = train.eval_max_new_tokens
        self._media_root = eval_path.parent if eval_path is not None else None
        self.rows: list[dict[str, Any]] = []
        if eval_path is not None and train.eval_samples > 0:
            self.rows = list(read_jsonl(eval_path))[: train.eval_samples]
        self.batches: list[ModelBatch] = []
        if train.eval_every > 0 and eval_path is not None:
            self.batches = held_out_batches(
                encoder,
                list(read_jsonl(eval_path))[: train.eval_loss_samples],
                batch_size=config.data.micro_batch_size,
                replica=ctx.dp_rank,
                replicas=ctx.dp_size,
                media_root=eval_path.parent,
                vlm=vlm,
                cp=ctx.cp_size,
            )

    def exact_match(self, model: nn.Module) -> float | None:
        """Greedy exact match on the held-out rows (None without rows), same on every rank."""
        if not self.rows:
            return None
        return exact_match_accuracy(
            model,
            self._processor,
            self.rows,
            max_new_tokens=self._max_new_tokens,
            device=self._ctx.device,
            media_root=self._media_root,
            tp=self._ctx.tp_size,
        )

    def loss(self, model: nn.Module) -> float | None:
        """Token-mean held-out loss (None without held-out batches), same on every rank."""
        if not self.batches:
            return None
        return held_out_loss(
            model,
            self.batches,
            loss_sum=self._loss_sum,
            device=self._ctx.device,
            cp=self._ctx.cp_size,
            tp=self._ctx.tp_size,
        )
