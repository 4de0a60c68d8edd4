"""One DPO micro-batch: the policy's and the reference's answer log-probs, the loss, the metrics.

# P pairs, S sequence
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from train_recipes.loss.preference_loss import preference_loss
from train_recipes.loss.sequence_log_probs import sequence_sums, token_log_probs_of

if TYPE_CHECKING:
    from train_recipes.config.dpo import DPOLossConfig
    from train_recipes.loss.fused_loss import CausalLM, ModelInputs

__all__ = ["DPOMetrics", "dpo_micro_batch"]

# The sums DPOMetrics keeps, in order.
_FIELDS = ("pairs", "correct", "margin", "chosen_reward", "rejected_reward", "logp_c", "logp_r")


class DPOMetrics:
    """Per-pair sums over the steps since the last read, on the device (no host sync per step).

    Read (collective over the ranks) as the means logged: ``rewards/margin``,
    ``rewards/accuracy`` (the fraction of pairs whose chosen reward is higher), the chosen and
    rejected rewards, and the policy's mean summed log-probs ``logps/chosen``,
    ``logps/rejected``.
    """

    def __init__(self, device: torch.device) -> None:
        self._sums = torch.zeros(len(_FIELDS), dtype=torch.float64, device=device)

    def add(self, chosen: Tensor, rejected: Tensor, logp_c: Tensor, logp_r: Tensor) -> None:
        """Add one micro-batch's [P] rewards and policy log-probs (detached)."""
        values = torch.stack(
            [
                torch.tensor(float(chosen.numel()), device=chosen.device, dtype=torch.float64),
                (chosen > rejected).sum().to(torch.float64),
                (chosen - rejected).sum().to(torch.float64),
                chosen.sum().to(torch.float64),
                rejected.sum().to(torch.float64),
                logp_c.detach().sum().to(torch.float64),
                logp_r.detach().sum().to(torch.float64),
            ]
        )
        self._sums += values

    def read_and_reset(self) -> dict[str, float]:
        """The means over every rank's pairs since the last read (collective)."""
        sums = self._sums.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        self._sums.zero_()
        n = max(float(sums[0]), 1.0)
        values = dict(zip(_FIELDS, (float(v) for v in sums), strict=True))
        return {
            "rewards/margin": values["margin"] / n,
            "rewards/accuracy": values["correct"] / n,
            "rewards/chosen": values["chosen_reward"] / n,
            "rewards/rejected": values["rejected_reward"] / n,
            "logps/chosen": values["logp_c"] / n,
            "logps/rejected": values["logp_r"] / n,
        }


def dpo_micro_batch(
    model: CausalLM,
    head: nn.Linear | None,
    batch: dict[str, Tensor],
    *,
    loss: DPOLossConfig,
    reference: nn.Module | None,
    reference_head: nn.Linear | None,
    metrics: DPOMetrics | None = None,
    chunk_tokens: int | None = None,
) -> Tensor:
    """The summed preference loss of one micro-batch of P pairs (2P rows, chosen first).

    Args:
        model: the Engine (one forward over all 2P rows: one DDP forward per backward).
        head: :func:`~train_recipes.loss.fused_loss.fused_head` of ``model`` (None: logits).
        batch: :func:`~train_recipes.dpo.pairs.collate_pairs` on the device; its
            ``reference`` [2P] column is used where there is no reference model.
        loss: the loss section of the config.
        reference: the frozen reference model (sigmoid DPO without columns), else None.
        reference_head: its fused head (None: logits).
        metrics: where the pairs' rewards and log-probs are added.
        chunk_tokens: tokens per chunk of the fused log-probs.

    Returns:
        0-dim float32: the sum of the P pairs' losses.
    """
    labels = batch["labels"]
    inputs: ModelInputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    p = labels.shape[0] // 2
    policy = sequence_sums(
        token_log_probs_of(model, head, inputs, labels, chunk_tokens=chunk_tokens), labels
    )  # [2P]
    ref: Tensor | None = None
    if loss.loss_type == "sigmoid":
        if reference is not None:
            with torch.no_grad():
                ref_tokens = token_log_probs_of(
                    reference, reference_head, inputs, labels, chunk_tokens=chunk_tokens
                )
            ref = sequence_sums(ref_tokens, labels)
        else:
            ref = batch["reference"]
    counts = (labels != -100).sum(-1).to(policy.dtype)
    terms = preference_loss(
        policy[:p],
        policy[p:],
        loss_type=loss.loss_type,
        beta=loss.beta,
        label_smoothing=loss.label_smoothing,
        reference_chosen=None if ref is None else ref[:p],
        reference_rejected=None if ref is None else ref[p:],
        chosen_tokens=counts[:p],
        rejected_tokens=counts[p:],
        simpo_gamma=loss.simpo_gamma,
        nll_weight=loss.nll_weight,
    )
    if metrics is not None:
        metrics.add(terms.chosen_rewards, terms.rejected_rewards, policy[:p], policy[p:])
    return terms.losses.sum()
