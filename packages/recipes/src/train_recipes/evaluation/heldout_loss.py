"""Held-out loss: the training objective on chats never trained on, split over all ranks.

The held-out chats are the eval split (``data.eval_path``, or the demo's held-out questions),
encoded by the same energon-sft encoder as the training data, so the loss is the training
loss's definition (token mean of -log p over the trained tokens) on other data. There is no
fallback to a slice of the training stream: a slice taken from it would still be trained on
by the loader's repeating stream; ``train.eval_every`` without held-out chats is refused before
launch.

Each data-parallel replica takes every dp-th chat (cp and tp ranks of a replica take the same
ones); the last batch of a replica with fewer chats is filled with a copy whose labels are all
ignored, so every rank runs the same number of forwards (FSDP2's forwards are collective).

# B batch, S sequence
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from train_recipes.data import energon_api as data_api
from train_recipes.data.energon_api import ChatRow, ModelBatch

if TYPE_CHECKING:
    from energon_sft import SFTTaskEncoder

logger = logging.getLogger(__name__)

__all__ = ["held_out_batches", "held_out_loss"]

#: (device batch, host batch) -> the sum over the batch's trained tokens of -log p, 0-dim.
LossSum = Callable[[ModelBatch, ModelBatch], Tensor]


def held_out_batches(
    encoder: SFTTaskEncoder,
    rows: Sequence[ChatRow],
    *,
    batch_size: int,
    replica: int,
    replicas: int,
    media_root: str | Path | None = None,
    vlm: bool = False,
    cp: int = 1,
) -> list[ModelBatch]:
    """This replica's held-out batches, on the host (built once, reused at every evaluation).

    Args:
        encoder: the training data's energon-sft ``SFTTaskEncoder``.
        rows: chats (``{"messages": [...], "media": [paths]}``).
        batch_size: chats per batch.
        replica: this data-parallel replica.
        replicas: the number of data-parallel replicas.
        media_root: the folder ``media`` paths are relative to.
        vlm: the image-text path (M-RoPE ids and media keys), as for training batches.
        cp: the context-parallel degree the rows are padded for.

    Returns:
        ``ceil(ceil(len(rows) / replicas) / batch_size)`` batches in ``batch_tensors`` form
        (``input_ids``, ``labels`` [B, S], ...), the same number on every replica.
    """
    if not rows:
        raise ValueError("no held-out chats to evaluate on")
    mine = list(rows[replica::replicas])
    per_replica = -(-len(rows) // replicas)
    num_batches = -(-per_replica // batch_size)
    # Filler rows (labels ignored) keep the number of forwards equal on every rank.
    real = [True] * len(mine) + [False] * (num_batches * batch_size - len(mine))
    mine += [rows[0]] * (len(real) - len(mine))
    batches = []
    for start in range(0, len(mine), batch_size):
        chunk, keep = mine[start : start + batch_size], real[start : start + batch_size]
        raw = data_api.collate_chat_rows(encoder, chunk, media_root=media_root)
        batch = data_api.batch_tensors(raw, vlm=vlm, cp=cp)
        batch["labels"][~torch.tensor(keep)] = -100
        # The filler rows' labels were just dropped: the loader's count no longer holds.
        batch["num_trainable_tokens"] = int((batch["labels"] != -100).sum())
        batches.append(batch)
    return batches


@torch.no_grad()
def held_out_loss(
    model: nn.Module,
    batches: Sequence[ModelBatch],
    *,
    loss_sum: LossSum,
    device: torch.device,
    cp: int = 1,
    tp: int = 1,
) -> float:
    """Token-mean held-out loss over all ranks (collective: every rank calls it).

    Args:
        model: the module whose train/eval mode is switched (restored afterwards).
        batches: this rank's :func:`held_out_batches`.
        loss_sum: the training loss's token sum for one batch (cp sharding included).
        device: this rank's device.
        cp: context-parallel degree: a replica's cp ranks each hold a part of its token sum.
        tp: tensor-parallel degree: a replica's tp ranks each hold all of its token sum (every
            cp and tp rank counts the replica's tokens).

    Returns:
        sum of -log p over all held-out trained tokens / their number, same on every rank.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, tokens]
    try:
        for host in batches:
            batch = data_api.to_device(host, device)
            totals[0] += loss_sum(batch, host).to(torch.float64)
            totals[1] += float(host["num_trainable_tokens"])
    finally:
        model.train(was_training)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    # Over all ranks the loss sum counts each token tp times, the token count cp*tp times.
    loss, tokens = float(totals[0]) / tp, float(totals[1]) / (cp * tp)
    return loss / tokens if tokens > 0 else float("nan")
