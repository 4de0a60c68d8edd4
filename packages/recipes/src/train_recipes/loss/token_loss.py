"""The SFT model path of one batch: the forward (sharded when needed) and its token-sum loss.

# B batch, S sequence, S_l local (cp-sharded) sequence, V vocabulary
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from train_recipes.loss.fused_loss import (
    CausalLM,
    ModelInputs,
    fused_head,
    token_sum_loss_with,
)

if TYPE_CHECKING:
    from cp_sharder import ContextParallelSharder
    from train_engine import Engine
    from train_recipes.data.energon_api import ModelBatch

__all__ = ["CausalLM", "TokenSumLoss", "token_sum_loss"]


@dataclass(kw_only=True, slots=True, frozen=True)
class TokenSumLoss:
    """The SFT loss path of a run, resolved once: which forward and which loss every batch takes.

    Unpacked text rows pass ``position_ids`` and no attention mask: right padding never reaches
    a real token under causal attention (energon-sft's padding positions continue the row, so
    they never read as a new document). Packed rows (``qkv_format == "thd"``) go through the
    ``sharder``, at cp=1 too: cp-sharder's variable-length attention keeps every document to
    itself, from ``seq_lens``, and no ``[S, S]`` mask is built. VLM batches pass [4, B, S]
    position ids (the 1-D ids, then the loader's M-RoPE ids, per packed document) and the
    images; the model's own M-RoPE builder would treat a packed row as one sequence. With a
    ``sharder`` the batch is sharded (cp > 1: over the cp ranks) and the forward runs in its
    context. A megatron-core model (``model.backend: megatron``) takes the same batch through
    ``train_recipes.megatron.training.megatron_token_sum_loss`` (no sharder: its attention
    reads the packed layout from ``PackedSeqParams``).

    Attributes:
        head: the output projection the fused loss replaces (:func:`fused_head` of the training
            model), None where the logits are materialised; the fused loss runs only with
            gradients enabled (evaluation reads the logits).
        megatron: the model is megatron-core's GPTModel.
        sharder: cp-sharder's ``ContextParallelSharder``; required for packed batches.
        vlm: batches are image-text batches (they must carry M-RoPE ids).
        chunk_tokens: tokens per chunk of the fused linear loss (the recipe's
            ``model.fused_loss_chunk_tokens``); None: vocab-parallel's default.
        trained_only: the fused loss sees only this rank's trained positions (the local
            labels != -100, counted on the device before the forward without a host sync;
            ``model.fused_loss_trained_only``); False: all positions.
    """

    head: nn.Linear | None
    megatron: bool = False
    sharder: ContextParallelSharder | None = None
    vlm: bool = False
    chunk_tokens: int | None = None
    trained_only: bool = True

    @classmethod
    def for_model(
        cls,
        model: CausalLM,
        *,
        sharder: ContextParallelSharder | None = None,
        vlm: bool = False,
        chunk_tokens: int | None = None,
        trained_only: bool = True,
    ) -> TokenSumLoss:
        """Resolve the loss path of ``model`` (the Engine, a wrapper or the model itself)."""
        from train_recipes.megatron.recipe import is_megatron_model

        megatron = is_megatron_model(model)
        return cls(
            head=None if megatron else fused_head(model),
            megatron=megatron,
            sharder=sharder,
            vlm=vlm,
            chunk_tokens=chunk_tokens,
            trained_only=trained_only,
        )

    def __call__(self, model: CausalLM, batch: ModelBatch) -> Tensor:
        """The sum over this rank's trained tokens of -log p(label): the loss of contract (b).

        Args:
            model: the model the path was resolved for (the Engine, or for evaluation the
                unwrapped model under ``torch.no_grad``).
            batch: ``input_ids`` [B, S], ``labels`` [B, S] (already shifted, -100 untrained),
                ``position_ids`` [B, S]; packed: ``qkv_format`` and ``seq_lens`` [B, N]; VLM:
                ``mrope_position_ids`` [3, B, S] and, when the batch has images,
                ``pixel_values`` [P, D] and ``image_grid_thw`` [N, 3] (see
                ``energon_api.batch_tensors``).

        Returns:
            0-dim float32 tensor.
        """
        if self.megatron:
            from train_recipes.megatron.training import megatron_token_sum_loss

            # GPTModel's forward takes its inputs by position: the DDP wrapper or the Engine
            return megatron_token_sum_loss(cast("nn.Module | Engine", model), batch)
        inputs = self._model_inputs(batch)
        if self.sharder is None:
            labels = cast(Tensor, inputs.pop("labels"))
            return self._loss(model, inputs, labels)
        train_ctx, local = self.sharder.shard(inputs)
        labels = local.pop("labels")  # the local labels: the trained rows are this rank's
        with train_ctx():
            return self._loss(model, local, labels)

    def _model_inputs(self, batch: ModelBatch) -> ModelInputs:
        inputs: ModelInputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        if self.vlm:
            if "mrope_position_ids" not in batch:
                raise ValueError(
                    "a VLM batch needs mrope_position_ids [3, B, S] (energon-sft builds them for "
                    "M-RoPE families); build the batch with energon_api.batch_tensors(batch, "
                    "vlm=True)"
                )
            inputs["position_ids"] = torch.cat(
                [batch["position_ids"].unsqueeze(0), batch["mrope_position_ids"]]
            )
            for name in ("pixel_values", "image_grid_thw"):  # absent for a text-only batch
                if name in batch:
                    inputs[name] = batch[name]
        elif "position_ids" in batch:
            inputs["position_ids"] = batch["position_ids"]
        if batch.get("qkv_format") == "thd":
            if self.sharder is None:
                raise ValueError(
                    "a packed batch (qkv_format='thd') needs cp-sharder's sharder (its "
                    "variable-length attention keeps documents apart); pass sharder=..."
                )
            inputs["qkv_format"] = "thd"
            inputs["seq_lens"] = batch["seq_lens"]
        return inputs

    def _loss(self, model: CausalLM, inputs: ModelInputs, labels: Tensor) -> Tensor:
        # No KV cache: training never reuses one.
        return token_sum_loss_with(
            model,
            self.head,
            inputs,
            labels,
            chunk_tokens=self.chunk_tokens,
            trained_only=self.trained_only,
        )


def token_sum_loss(
    model: CausalLM,
    batch: ModelBatch,
    *,
    sharder: ContextParallelSharder | None = None,
    vlm: bool = False,
    chunk_tokens: int | None = None,
    trained_only: bool = True,
) -> Tensor:
    """One batch's token-sum loss, the path resolved for this call (:class:`TokenSumLoss`).

    For a single call (tests, tools); a run resolves its :class:`TokenSumLoss` once.
    """
    loss = TokenSumLoss.for_model(
        model, sharder=sharder, vlm=vlm, chunk_tokens=chunk_tokens, trained_only=trained_only
    )
    return loss(model, batch)
