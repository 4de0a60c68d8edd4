"""The DPO recipe's losses against float64 references written from the papers' formulas: sigmoid
DPO (with label smoothing) and SimPO on random pairs, their margins, accuracies and gradients;
then one whole micro-batch (chat-rendered pairs, the policy's and the frozen reference's answer
log-probs through vocab-parallel, the loss) against a float64 model's log_softmax."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from train_recipes.config.dpo import DPOLossConfig
from train_recipes.dpo.pairs import collate_pairs, encode_pair
from train_recipes.dpo.step import DPOMetrics, dpo_micro_batch
from train_recipes.loss.fused_loss import fused_head
from train_recipes.loss.preference_loss import preference_loss


def _log_sigmoid64(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _dpo_reference(pc, pr, rc, rr, beta, eps):  # type: ignore[no-untyped-def]
    """Rafailov et al. (2023), eq. 7, with cDPO's label smoothing: per pair, in float64."""
    out = []
    for a, b, c, d in zip(pc, pr, rc, rr, strict=True):
        z = beta * ((a - c) - (b - d))
        out.append(-(1 - eps) * _log_sigmoid64(z) - eps * _log_sigmoid64(-z))
    return out


def _simpo_reference(pc, pr, nc, nr, beta, gamma, eps):  # type: ignore[no-untyped-def]
    """Meng et al. (2024), eq. 6: -log sigmoid(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma)."""
    out = []
    for a, b, n, m in zip(pc, pr, nc, nr, strict=True):
        z = beta * a / n - beta * b / m - gamma
        out.append(-(1 - eps) * _log_sigmoid64(z) - eps * _log_sigmoid64(-z))
    return out


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_sigmoid_dpo_equals_the_formula(eps: float) -> None:
    gen = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-10 * torch.rand(16, generator=gen, dtype=torch.float64) for _ in range(4))
    beta = 0.3
    pc32, pr32 = pc.float().requires_grad_(), pr.float().requires_grad_()
    terms = preference_loss(
        pc32,
        pr32,
        loss_type="sigmoid",
        beta=beta,
        label_smoothing=eps,
        reference_chosen=rc.float(),
        reference_rejected=rr.float(),
    )
    expected = _dpo_reference(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), beta, eps)
    # float32 arithmetic against float64: ~1e-7 relative
    torch.testing.assert_close(
        terms.losses.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(
        terms.chosen_rewards.double(), beta * (pc - rc), rtol=1e-5, atol=1e-6
    )
    margin = beta * ((pc - rc) - (pr - rr))
    got_margin = terms.chosen_rewards - terms.rejected_rewards
    torch.testing.assert_close(got_margin.double(), margin, rtol=1e-5, atol=1e-5)
    # Gradients: autograd of the float64 formula written with torch ops, independently.
    a, b = pc.clone().requires_grad_(), pr.clone().requires_grad_()
    z = beta * ((a - rc) - (b - rr))
    ref_loss = (-(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))).sum()
    ref_loss.backward()
    terms.losses.sum().backward()
    assert pc32.grad is not None and pr32.grad is not None and a.grad is not None
    torch.testing.assert_close(pc32.grad.double(), a.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(pr32.grad.double(), b.grad, rtol=1e-5, atol=1e-7)


def test_simpo_equals_the_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    pc, pr = (-10 * torch.rand(16, generator=gen, dtype=torch.float64) for _ in range(2))
    nc, nr = (torch.randint(1, 9, (16,), generator=gen).double() for _ in range(2))
    beta, gamma = 2.0, 0.5
    pc32, pr32 = pc.float().requires_grad_(), pr.float().requires_grad_()
    terms = preference_loss(
        pc32,
        pr32,
        loss_type="simpo",
        beta=beta,
        chosen_tokens=nc.float(),
        rejected_tokens=nr.float(),
        simpo_gamma=gamma,
    )
    expected = _simpo_reference(
        pc.tolist(), pr.tolist(), nc.tolist(), nr.tolist(), beta, gamma, 0.0
    )
    # float32 arithmetic against float64: ~1e-7 relative
    torch.testing.assert_close(
        terms.losses.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6
    )
    terms.losses.sum().backward()
    # d/d pc of -log sigmoid(z) = -sigmoid(-z) * beta / nc
    z = beta * pc / nc - beta * pr / nr - gamma
    assert pc32.grad is not None and pr32.grad is not None
    torch.testing.assert_close(
        pc32.grad.double(), -torch.sigmoid(-z) * beta / nc, rtol=1e-5, atol=1e-7
    )
    torch.testing.assert_close(
        pr32.grad.double(), torch.sigmoid(-z) * beta / nr, rtol=1e-5, atol=1e-7
    )


def test_missing_inputs_are_refused() -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="reference_chosen"):
        preference_loss(x, x, loss_type="sigmoid", beta=0.1)
    with pytest.raises(ValueError, match="chosen_tokens"):
        preference_loss(x, x, loss_type="simpo", beta=0.1)


def _answer_log_prob64(model: torch.nn.Module, ids: tuple[int, ...], start: int) -> float:
    """Sum over the answer tokens ids[start:] of log p(token | prefix), float64 model."""
    x = torch.tensor([ids])
    with torch.no_grad():
        log_p = torch.log_softmax(model(input_ids=x).logits.double()[0], dim=-1)
    return float(sum(log_p[t - 1, ids[t]] for t in range(start, len(ids))))


def test_micro_batch_equals_float64_model_on_chat_pairs() -> None:
    """A whole micro-batch: pairs rendered with the demo chat template, padded, the policy's
    (fused head) and the reference's log-probs, the DPO loss and its metrics."""
    from train_recipes.data.demo import build_char_tokenizer
    from train_testing.tiny_hf import tiny_model

    tokenizer = build_char_tokenizer()
    policy = tiny_model("llama", seed=0, vocab_size=len(tokenizer), init_std=0.2)
    reference = tiny_model("llama", seed=1, vocab_size=len(tokenizer), init_std=0.2)
    reference.requires_grad_(False)
    rows = [
        {"prompt": [{"role": "user", "content": "12+30="}], "chosen": "42", "rejected": "41"},
        {"prompt": [{"role": "user", "content": "7+5="}], "chosen": "12", "rejected": "102"},
        {"prompt": [{"role": "user", "content": "99+1="}], "chosen": "100", "rejected": "10"},
    ]
    pairs = [encode_pair(tokenizer, r, max_length=32, where=f"row {i}") for i, r in enumerate(rows)]
    batch = collate_pairs(pairs, pad_token_id=int(tokenizer.pad_token_id))
    loss_config = DPOLossConfig(loss_type="sigmoid", beta=0.5, label_smoothing=0.1)
    metrics = DPOMetrics(torch.device("cpu"))
    p64, r64 = copy.deepcopy(policy).double(), copy.deepcopy(reference).double()
    loss = dpo_micro_batch(
        policy,
        fused_head(policy),
        batch,
        loss=loss_config,
        reference=reference,
        reference_head=fused_head(reference),
        metrics=metrics,
    )
    pc = [_answer_log_prob64(p64, p.chosen, p.chosen_start) for p in pairs]
    pr = [_answer_log_prob64(p64, p.rejected, p.rejected_start) for p in pairs]
    rc = [_answer_log_prob64(r64, p.chosen, p.chosen_start) for p in pairs]
    rr = [_answer_log_prob64(r64, p.rejected, p.rejected_start) for p in pairs]
    expected = sum(_dpo_reference(pc, pr, rc, rr, 0.5, 0.1))
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    read = metrics.read_and_reset()
    margins = [0.5 * ((a - c) - (b - d)) for a, b, c, d in zip(pc, pr, rc, rr, strict=True)]
    assert read["rewards/margin"] == pytest.approx(sum(margins) / 3, rel=1e-4, abs=1e-6)
    assert read["rewards/accuracy"] == pytest.approx(sum(m > 0 for m in margins) / 3)
    assert read["logps/chosen"] == pytest.approx(sum(pc) / 3, rel=1e-5)
    assert read["logps/rejected"] == pytest.approx(sum(pr) / 3, rel=1e-5)
    # The answer tokens include the end-of-turn token: "42" + <|end|> is 3 tokens.
    assert int((batch["labels"][0] != -100).sum()) == 3
    loss.backward()
    assert all(p.grad is None for p in reference.parameters())
    assert policy.get_output_embeddings().weight.grad is not None


def test_nll_weight_adds_the_chosen_mean_token_nll() -> None:
    """RPO: loss + alpha * (-log pi(y_w) / |y_w|), per pair, from the formula."""
    gen = torch.Generator().manual_seed(3)
    pc, pr, rc, rr = (-10 * torch.rand(8, generator=gen, dtype=torch.float64) for _ in range(4))
    nc = torch.randint(1, 9, (8,), generator=gen).double()
    terms = preference_loss(
        pc.float(),
        pr.float(),
        loss_type="sigmoid",
        beta=0.2,
        reference_chosen=rc.float(),
        reference_rejected=rr.float(),
        chosen_tokens=nc.float(),
        rejected_tokens=nc.float(),
        nll_weight=0.7,
    )
    dpo = torch.tensor(_dpo_reference(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), 0.2, 0.0))
    expected = dpo.double() + 0.7 * (-pc / nc)
    torch.testing.assert_close(terms.losses.double(), expected, rtol=1e-6, atol=1e-6)
