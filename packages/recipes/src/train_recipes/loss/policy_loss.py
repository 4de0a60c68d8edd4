"""The GRPO/PPO policy loss: clipped ratio, KL to a reference, entropy bonus; group advantages.

Per trained (completion) token t, with r_t = exp(log p_t - old_t)::

    loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
             + kl_coef * KL_t(log p_t, ref_t) - entropy_coef * H_t

summed over the trained tokens (the token-sum contract: the Engine divides by the global
count). Each term reads only its own token's log-prob and entropy, so the sum goes through
vocab-parallel's ``fused_linear_log_prob_loss`` (three logits-sized matmuls, no [B, S, V]
logits, gradients formed in forward) where the head allows it, and through the materialised
logits (``token_log_probs_and_entropy``) otherwise; both evaluate :func:`policy_token_loss`.

# B batch, S (local) sequence, H hidden, V vocabulary, N samples
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from train_recipes.config.grpo import PolicyLossConfig
from train_recipes.loss.fused_loss import CausalLM, ModelInputs, hidden_and_head_weight

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "PolicyLoss",
    "PolicyTokens",
    "group_advantages",
    "kl_estimate",
    "policy_loss_from_hidden",
    "policy_loss_from_logits",
    "policy_loss_of",
    "policy_token_loss",
]

IGNORE_INDEX = -100


def kl_estimate(log_p: Tensor, ref_log_p: Tensor, estimator: str) -> Tensor:
    """A per-token estimate of KL(policy || reference) from the sampled token's log-probs.

    Schulman's estimators with d = log p_ref - log p: k1 = -d, k3 = exp(d) - 1 - d (unbiased,
    never negative, lower variance).

    Args:
        log_p: [...] the policy's log-probs of the sampled tokens.
        ref_log_p: [...] the reference's.
        estimator: "k1" or "k3".

    Returns:
        [...] the estimate per token.
    """
    d = ref_log_p - log_p
    if estimator == "k1":
        return -d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"loss.kl_estimator={estimator!r} is not one of ['k1', 'k3']")


def policy_token_loss(
    log_p: Tensor,
    entropy: Tensor,
    old_log_p: Tensor | None,
    advantage: Tensor,
    ref_log_p: Tensor | None,
    config: PolicyLossConfig,
) -> Tensor:
    """The loss of each token (elementwise in every argument).

    Args:
        log_p: [...] log p(token) under the policy being trained.
        entropy: [...] the policy's softmax entropy at the token's position.
        old_log_p: [...] the log-probs the rollout was sampled with; None: the detached
            ``log_p`` itself (an on-policy update: the ratio is exactly 1).
        advantage: [...] the token's advantage.
        ref_log_p: [...] the reference model's log-probs (needed when ``kl_coef`` > 0).
        config: the clip range and coefficients.

    Returns:
        [...] loss_t.
    """
    old = log_p.detach() if old_log_p is None else old_log_p
    ratio = torch.exp(log_p - old)
    clipped = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    loss = -torch.minimum(ratio * advantage, clipped * advantage)
    if config.kl_coef:
        if ref_log_p is None:
            raise ValueError("loss.kl_coef > 0 needs the reference's log-probs (ref_log_p)")
        loss = loss + config.kl_coef * kl_estimate(log_p, ref_log_p, config.kl_estimator)
    if config.entropy_coef:
        loss = loss - config.entropy_coef * entropy
    return loss


@dataclass(kw_only=True, slots=True, frozen=True)
class PolicyTokens:
    """The per-token constants of a batch of rollouts, aligned with the shifted labels.

    Attributes:
        advantages: [B, S] float32 (0 where nothing is trained).
        old_log_p: [B, S] float32 log-probs the rollouts were sampled with; None: on-policy
            (the detached current log-probs).
        ref_log_p: [B, S] float32 reference log-probs; None without a KL term.
    """

    advantages: Tensor
    old_log_p: Tensor | None = None
    ref_log_p: Tensor | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class PolicyLoss:
    """One batch's policy loss and what it saw.

    Attributes:
        loss: 0-dim float32, the sum of loss_t over the trained tokens.
        log_p: [B, S] float32 detached log-probs (0 where nothing is trained).
        entropy: [B, S] float32 detached entropies (0 where nothing is trained).
    """

    loss: Tensor
    log_p: Tensor
    entropy: Tensor


def _token_fn(
    tokens: PolicyTokens, config: PolicyLossConfig
) -> tuple[Callable[..., Tensor], tuple[Tensor, ...]]:
    """``token_loss(log_p, entropy, *inputs)`` for vocab-parallel, and its inputs."""
    inputs = [tokens.advantages]
    if tokens.old_log_p is not None:
        inputs.append(tokens.old_log_p)
    with_ref = bool(config.kl_coef)
    if with_ref:
        if tokens.ref_log_p is None:
            raise ValueError("loss.kl_coef > 0 needs the reference's log-probs (ref_log_p)")
        inputs.append(tokens.ref_log_p)
    has_old = tokens.old_log_p is not None

    def token_loss(log_p: Tensor, entropy: Tensor, advantage: Tensor, *rest: Tensor) -> Tensor:
        old = rest[0] if has_old else None
        ref = rest[-1] if with_ref else None
        return policy_token_loss(log_p, entropy, old, advantage, ref, config)

    return token_loss, tuple(inputs)


def policy_loss_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    tokens: PolicyTokens,
    config: PolicyLossConfig,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> PolicyLoss:
    """The loss from the final hidden states and the head's weight, without the logits.

    Args:
        hidden: [B, S, H].
        weight: [V, H] (a vocabulary shard under tensor parallelism).
        labels: [B, S] shifted completion tokens, -100 elsewhere.
        tokens: the per-token constants.
        config: the clip range and coefficients.
        temperature: the log-probs and entropies are those of softmax(logits / temperature).
        chunk_tokens: tokens per chunk (None: vocab-parallel's default).

    Returns:
        The loss (gradients formed in forward) and the detached log-probs and entropies.
    """
    import vocab_parallel as vp

    fn, inputs = _token_fn(tokens, config)
    loss, log_p, entropy = vp.fused_linear_log_prob_loss(  # type: ignore[misc]
        hidden,
        weight,
        labels,
        fn,
        inputs,
        temperature=temperature,
        chunk_size=chunk_tokens,
        return_log_probs=True,
        with_entropy=True,
    )
    return PolicyLoss(loss=loss, log_p=log_p, entropy=entropy)


def policy_loss_from_logits(
    logits: Tensor,
    labels: Tensor,
    tokens: PolicyTokens,
    config: PolicyLossConfig,
    *,
    temperature: float = 1.0,
) -> PolicyLoss:
    """The same loss read from materialised logits [B, S, V] (any head; a DTensor may shard V)."""
    import vocab_parallel as vp

    log_p, entropy = vp.token_log_probs_and_entropy(logits, labels, temperature=temperature)
    fn, inputs = _token_fn(tokens, config)
    trained = labels != IGNORE_INDEX
    per_token = fn(log_p, entropy, *inputs)
    loss = torch.where(trained, per_token, torch.zeros_like(per_token)).sum()
    zero = torch.zeros_like(log_p)
    return PolicyLoss(
        loss=loss,
        log_p=torch.where(trained, log_p.detach(), zero),
        entropy=torch.where(trained, entropy.detach(), zero),
    )


def policy_loss_of(
    model: CausalLM,
    head: nn.Linear | None,
    inputs: ModelInputs,
    labels: Tensor,
    tokens: PolicyTokens,
    config: PolicyLossConfig,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> PolicyLoss:
    """The policy loss of one batch through ``model``: fused with a plain head, else logits.

    Args:
        model: the Engine (or a wrapper, or the model).
        head: :func:`train_recipes.loss.fused_loss.fused_head` of the training model; None
            reads the logits.
        inputs: ``input_ids`` [B, S], ``position_ids`` [B, S].
        labels: [B, S] shifted completion tokens, -100 elsewhere.
        tokens: the per-token constants.
        config: the clip range and coefficients.
        temperature: the sampling temperature.
        chunk_tokens: tokens per chunk of the fused form.
    """
    if head is not None:
        hidden, weight = hidden_and_head_weight(model, head, inputs)
        return policy_loss_from_hidden(
            hidden,
            weight,
            labels,
            tokens,
            config,
            temperature=temperature,
            chunk_tokens=chunk_tokens,
        )
    logits = model(**inputs, use_cache=False).logits  # [B, S, V]
    return policy_loss_from_logits(logits, labels, tokens, config, temperature=temperature)


def group_advantages(rewards: Tensor, groups: Tensor, *, eps: float) -> Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's std plus eps.

    The standard deviation is the sample one (Bessel's correction, as TRL's GRPO); a group of
    one sample, or of equal rewards, gets advantage 0.

    Args:
        rewards: [N] float.
        groups: [N] int64 group index of each sample (e.g. its prompt), in [0, N).
        eps: added to the standard deviation.

    Returns:
        [N] float32.
    """
    rewards = rewards.to(torch.float64)
    n_groups = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add(
        0, groups, torch.ones_like(rewards)
    )
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add(0, groups, rewards) / count.clamp(
        min=1
    )
    centred = rewards - mean[groups]
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add(0, groups, centred**2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return (centred / (std[groups] + eps)).to(torch.float32)
