"""The policy update's parts that read the models: log-probs of a buffer, one step's statistics.

# N samples on this rank, S row length
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from train_recipes.config.grpo import PolicyLossConfig
from train_recipes.grpo.buffer import RolloutBuffer
from train_recipes.loss.fused_loss import CausalLM, ModelInputs, fused_head
from train_recipes.loss.policy_loss import PolicyLoss, PolicyTokens, kl_estimate
from train_recipes.loss.sequence_log_probs import token_log_probs_of

__all__ = ["buffer_log_probs", "step_statistics"]

IGNORE_INDEX = -100


@torch.no_grad()
def buffer_log_probs(
    model: nn.Module,
    buffer: RolloutBuffer,
    *,
    minibatches: int,
    device: torch.device,
    temperature: float,
) -> Tensor:
    """Log p(label) [N, S] of every row of ``buffer`` under ``model`` (0 where untrained).

    One forward per minibatch (the sizes the update runs), so that collective forwards (FSDP2,
    tensor parallelism) run the same number of times on every rank.
    """
    head = fused_head(model)
    out = torch.zeros(buffer.labels.shape, dtype=torch.float32)
    for k in range(minibatches):
        part = buffer.rows_of(k, minibatches)
        inputs: ModelInputs = {
            "input_ids": buffer.input_ids[part].to(device),
            "position_ids": buffer.position_ids[part].to(device),
        }
        labels = buffer.labels[part].to(device)
        causal_lm: CausalLM = model
        log_p = token_log_probs_of(causal_lm, head, inputs, labels, temperature=temperature)
        out[part] = log_p.float().cpu()
    return out


def step_statistics(
    out: PolicyLoss,
    labels: Tensor,
    tokens: PolicyTokens,
    config: PolicyLossConfig,
    *,
    group: dist.ProcessGroup | None,
) -> dict[str, float]:
    """The step's ratio, clipping, KL and entropy over the trained tokens of all dp ranks.

    Collective over ``group``. Returns ``ratio_mean``, ``ratio_min``, ``ratio_max``,
    ``clip_fraction`` (tokens whose ratio is outside the clip range), ``entropy`` and, with a
    reference, ``kl`` (the configured estimator), each a token mean.
    """
    trained = labels != IGNORE_INDEX
    log_p = out.log_p[trained].double()
    old = log_p if tokens.old_log_p is None else tokens.old_log_p[trained].double()
    ratio = torch.exp(log_p - old)
    clipped = (ratio < 1 - config.eps_low) | (ratio > 1 + config.eps_high)
    kl = torch.zeros((), dtype=torch.float64, device=log_p.device)
    if tokens.ref_log_p is not None:
        ref = tokens.ref_log_p[trained].double()
        kl = kl_estimate(log_p, ref, config.kl_estimator).sum()
    sums = torch.stack(
        [
            ratio.sum(),
            clipped.sum().double(),
            out.entropy[trained].double().sum(),
            kl,
            torch.tensor(float(ratio.numel()), dtype=torch.float64, device=log_p.device),
        ]
    )
    big = torch.finfo(torch.float64).max
    extremes = torch.stack(
        [
            ratio.max() if ratio.numel() else torch.tensor(-big, dtype=torch.float64),
            -ratio.min() if ratio.numel() else torch.tensor(-big, dtype=torch.float64),
        ]
    ).to(log_p.device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    n = max(float(sums[4]), 1.0)
    stats = {
        "ratio_mean": float(sums[0]) / n,
        "ratio_min": -float(extremes[1]),
        "ratio_max": float(extremes[0]),
        "clip_fraction": float(sums[1]) / n,
        "entropy": float(sums[2]) / n,
    }
    if tokens.ref_log_p is not None:
        stats["kl"] = float(sums[3]) / n
    return stats
