"""Equalization on one process (no process group: the count is this rank's own)."""

from __future__ import annotations

import pytest
import torch

from moe_dispatch import (
    EqualizingDispatcher,
    ExpertParallelMoE,
    LocalDispatcher,
    MoEConfig,
    equalize_token_counts,
    padded_token_count,
)


def _routing(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 6, generator=g)
    probs = torch.softmax(torch.randn(tokens, 4, generator=g), -1)
    weights, ids = torch.topk(probs, 2)
    return hidden, ids, weights


def test_padded_token_count_rounds_up_and_never_returns_zero() -> None:
    assert padded_token_count(5) == 8
    assert padded_token_count(8) == 8
    assert padded_token_count(0) == 4
    assert padded_token_count(17, alignment=16) == 32
    with pytest.raises(ValueError, match="alignment must be >= 1"):
        padded_token_count(3, alignment=0)


def test_padding_rows_route_nowhere_and_carry_no_gradient() -> None:
    hidden, ids, weights = _routing(5)
    hidden.requires_grad_()
    weights.requires_grad_()
    padded = equalize_token_counts(hidden, ids, weights)
    assert padded.padded_size == 8 and padded.num_tokens == 5
    assert torch.equal(padded.topk_ids[5:], torch.full((3, 2), -1))
    assert torch.equal(padded.topk_weights[5:], torch.zeros(3, 2))
    assert torch.equal(padded.hidden[5:], torch.zeros(3, 6))
    assert padded.valid_mask().tolist() == [True] * 5 + [False] * 3
    assert torch.equal(padded.unpad(padded.hidden), hidden)
    (padded.hidden.sum() + padded.topk_weights.sum()).backward()
    assert hidden.grad is not None and weights.grad is not None
    assert torch.equal(hidden.grad, torch.ones(5, 6))


def test_host_provided_size_is_checked() -> None:
    hidden, ids, weights = _routing(6)
    assert equalize_token_counts(hidden, ids, weights, padded_size=12).padded_size == 12
    with pytest.raises(ValueError, match="padded_size=4 must be >= this rank's token count 6"):
        equalize_token_counts(hidden, ids, weights, padded_size=4)
    with pytest.raises(ValueError, match="multiple of alignment=4"):
        equalize_token_counts(hidden, ids, weights, padded_size=10)


@pytest.mark.parametrize("tokens", [0, 3, 8])
def test_equalized_moe_equals_unpadded_exactly(tokens: int) -> None:
    config = MoEConfig(hidden_size=6, intermediate_size=5, num_experts=4, top_k=2)
    torch.manual_seed(3)
    plain = ExpertParallelMoE(config)
    padded = ExpertParallelMoE(config, dispatcher=EqualizingDispatcher(LocalDispatcher(4)))
    padded.load_state_dict(plain.state_dict())
    x = torch.randn(tokens, 6)
    outs, grads = [], []
    for moe in (plain, padded):
        xi = x.clone().requires_grad_()
        out = moe(xi)
        out.pow(2).sum().backward()
        outs.append(out)
        grads.append([xi.grad, *(p.grad for p in moe.parameters())])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(grads[0], grads[1], strict=True):
        assert a is not None and b is not None and torch.equal(a, b)
