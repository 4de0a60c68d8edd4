"""The GRPO policy loss against a float64 reference written from the formula (fwd and grads).

The reference forms the logits, log-softmax, the label's log-prob and the entropy in float64 with
plain PyTorch, then the clipped surrogate, Schulman's k1/k3 KL estimators and the entropy bonus
as the PPO/GRPO papers write them; gradients are autograd's.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from train_recipes.config.grpo import PolicyLossConfig
from train_recipes.loss.policy_loss import (
    PolicyTokens,
    group_advantages,
    policy_loss_from_hidden,
    policy_loss_from_logits,
)
from train_testing.reference import max_relative_error

B, S, H, V = 3, 7, 16, 40


def _case(seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[:, :2] = -100  # the prompt
    labels[1, -2:] = -100  # right padding
    # Old and reference log-probs near the current ones, some ratios beyond the clip.
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels.clamp(min=0)[..., None])
        logp = logp[..., 0]
    old = logp + 0.4 * torch.randn(B, S, generator=g)
    ref = logp + 0.3 * torch.randn(B, S, generator=g)
    adv = torch.randn(B, S, generator=g)
    return {
        "hidden": hidden,
        "weight": weight,
        "labels": labels,
        "old": old,
        "ref": ref,
        "adv": adv,
    }


def _reference(
    case: dict[str, Tensor], cfg: PolicyLossConfig, temperature: float
) -> tuple[float, Tensor, Tensor]:
    """Sum over trained tokens of the GRPO token loss, float64, from the formula."""
    hidden = case["hidden"].double().requires_grad_()
    weight = case["weight"].double().requires_grad_()
    labels = case["labels"]
    mask = labels != -100
    logits = hidden @ weight.T / temperature
    log_probs = F.log_softmax(logits, dim=-1)
    log_p = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    old, ref, adv = case["old"].double(), case["ref"].double(), case["adv"].double()
    ratio = torch.exp(log_p - old)
    surrogate = torch.minimum(
        ratio * adv, torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv
    )
    if cfg.kl_estimator == "k1":
        kl = log_p - ref
    else:  # k3 = r - 1 - log r with r = p_ref / p
        r = torch.exp(ref - log_p)
        kl = r - 1 - torch.log(r)
    per_token = -surrogate + cfg.kl_coef * kl - cfg.entropy_coef * entropy
    loss = per_token[mask].sum()
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    return float(loss.detach()), hidden.grad, weight.grad


CONFIGS = [
    PolicyLossConfig(eps_low=0.2, eps_high=0.28, kl_coef=0.0, entropy_coef=0.0),
    PolicyLossConfig(eps_low=0.2, eps_high=0.2, kl_coef=0.1, kl_estimator="k1"),
    PolicyLossConfig(eps_low=0.1, eps_high=0.3, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01),
]


@pytest.mark.parametrize("path", ["fused", "logits"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["clip", "k1", "k3+entropy"])
def test_policy_loss_matches_the_float64_formula(path: str, cfg: PolicyLossConfig) -> None:
    case = _case(0)
    temperature = 0.8
    want_loss, want_dh, want_dw = _reference(case, cfg, temperature)
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    tokens = PolicyTokens(advantages=case["adv"], old_log_p=case["old"], ref_log_p=case["ref"])
    if path == "fused":
        out = policy_loss_from_hidden(
            hidden, weight, case["labels"], tokens, cfg, temperature=temperature, chunk_tokens=5
        )
    else:
        out = policy_loss_from_logits(
            hidden @ weight.T, case["labels"], tokens, cfg, temperature=temperature
        )
    out.loss.backward()
    got_loss = float(out.loss.detach())
    assert abs(got_loss - want_loss) <= 1e-5 * (1 + abs(want_loss)), (got_loss, want_loss)
    for name, got, want in (("hidden", hidden.grad, want_dh), ("weight", weight.grad, want_dw)):
        err = max_relative_error(got, want)
        assert err < 1e-5, f"{path} d loss / d {name}: max relative error {err:.2e}"
    # Some ratios are clipped in this case: the clip branch is exercised, not only the identity.
    mask = case["labels"] != -100
    ratio = torch.exp(out.log_p - case["old"])[mask]
    assert ((ratio < 1 - cfg.eps_low) | (ratio > 1 + cfg.eps_high)).any()


@pytest.mark.parametrize("path", ["fused", "logits"])
def test_on_policy_ratio_is_exactly_one(path: str) -> None:
    """Without old log-probs (one update of fresh rollouts) the ratio is the detached current
    log-prob's: exactly 1, so the loss is -sum A and its gradient -A d log p."""
    case = _case(1)
    cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.2)
    hidden = case["hidden"].clone().requires_grad_()
    tokens = PolicyTokens(advantages=case["adv"])
    if path == "fused":
        out = policy_loss_from_hidden(hidden, case["weight"], case["labels"], tokens, cfg)
    else:
        out = policy_loss_from_logits(hidden @ case["weight"].T, case["labels"], tokens, cfg)
    mask = case["labels"] != -100
    assert float(out.loss.detach()) == pytest.approx(-float(case["adv"][mask].sum()), rel=1e-6)
    out.loss.backward()
    # Reference: the REINFORCE gradient -sum_t A_t d log p_t, float64.
    h64 = case["hidden"].double().requires_grad_()
    log_p = F.log_softmax(h64 @ case["weight"].double().T, -1)
    log_p = log_p.gather(-1, case["labels"].clamp(min=0)[..., None])[..., 0]
    (-(case["adv"].double() * log_p)[mask].sum()).backward()
    assert max_relative_error(hidden.grad, h64.grad) < 1e-5


def test_group_advantages_normalise_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3])
    got = group_advantages(rewards, groups, eps=1e-4)
    want = []
    for r, gid in zip(rewards.tolist(), groups.tolist(), strict=True):
        members = [x for x, h in zip(rewards.tolist(), groups.tolist(), strict=True) if h == gid]
        if len(members) == 1:
            want.append(0.0)
            continue
        want.append((r - statistics.mean(members)) / (statistics.stdev(members) + 1e-4))
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-7)
