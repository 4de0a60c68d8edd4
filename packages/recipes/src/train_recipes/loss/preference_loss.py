"""Preference losses on sequence log-probs: sigmoid DPO and reference-free SimPO.

# P pairs

Inputs are the summed answer log-probs of each pair's chosen and rejected answer under the
policy (differentiable) and, for DPO, under the frozen reference (constants). The losses are
per pair; the recipe sums them and the Engine divides by the global pair count (the token-sum
contract with pairs as the unit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.nn.functional as F
from torch import Tensor

__all__ = ["PreferenceTerms", "preference_loss"]


@dataclass(kw_only=True, slots=True, frozen=True)
class PreferenceTerms:
    """One micro-batch's per-pair terms.

    Attributes:
        losses: [P] float32, differentiable.
        chosen_rewards: [P] the implicit reward of the chosen answer (detached): DPO's
            beta * (policy - reference log-prob), SimPO's beta * mean answer log-prob.
        rejected_rewards: [P] the same for the rejected answer.
    """

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def preference_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    *,
    loss_type: Literal["sigmoid", "simpo"],
    beta: float,
    label_smoothing: float = 0.0,
    reference_chosen: Tensor | None = None,
    reference_rejected: Tensor | None = None,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
    simpo_gamma: float = 0.5,
    nll_weight: float = 0.0,
) -> PreferenceTerms:
    """The per-pair preference loss.

    sigmoid (DPO): z = beta * ((pi_c - ref_c) - (pi_r - ref_r));
    simpo: z = beta * (pi_c / n_c - pi_r / n_r) - gamma;
    loss = -(1 - eps) * log sigmoid(z) - eps * log sigmoid(-z), eps = ``label_smoothing``,
    plus ``nll_weight * (-pi_c / n_c)``: the chosen answer's mean token negative log-likelihood
    (RPO, Pang et al. 2024; TRL's ``rpo_alpha``), which keeps DPO from lowering the chosen
    answer's likelihood along with the rejected one's.

    Args:
        policy_chosen: [P] summed log-probs of the chosen answers under the policy.
        policy_rejected: [P] the same for the rejected answers.
        loss_type: "sigmoid" or "simpo".
        beta: the reward's inverse temperature.
        label_smoothing: eps in [0, 0.5).
        reference_chosen: [P] the reference's summed log-probs (sigmoid only; required).
        reference_rejected: [P] (sigmoid only; required).
        chosen_tokens: [P] answer token counts n_c (simpo only; required).
        rejected_tokens: [P] n_r (simpo only; required).
        simpo_gamma: SimPO's target margin.
        nll_weight: weight of the chosen answers' mean token NLL (needs ``chosen_tokens``).

    Returns:
        :class:`PreferenceTerms`.

    Raises:
        ValueError: the inputs the loss type needs are missing.
    """
    if loss_type == "sigmoid":
        if reference_chosen is None or reference_rejected is None:
            raise ValueError("loss_type 'sigmoid' needs reference_chosen and reference_rejected")
        chosen = beta * (policy_chosen - reference_chosen)
        rejected = beta * (policy_rejected - reference_rejected)
        z = chosen - rejected
    elif loss_type == "simpo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type 'simpo' needs chosen_tokens and rejected_tokens")
        chosen = beta * policy_chosen / chosen_tokens.clamp(min=1)
        rejected = beta * policy_rejected / rejected_tokens.clamp(min=1)
        z = chosen - rejected - simpo_gamma
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected 'sigmoid' or 'simpo'")
    losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    if nll_weight:
        if chosen_tokens is None:
            raise ValueError("nll_weight needs chosen_tokens")
        losses = losses - nll_weight * policy_chosen / chosen_tokens.clamp(min=1)
    return PreferenceTerms(
        losses=losses, chosen_rewards=chosen.detach(), rejected_rewards=rejected.detach()
    )
