"""Pure index math and the single-process dispatcher (no process group)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch import (
    Dispatcher,
    EqualizingDispatcher,
    LocalDispatcher,
    expert_load,
    expert_range,
    load_balancing_loss,
)
from moe_dispatch.routing import (
    group_major_to_expert_major,
    inverse_permutation,
    sort_by_expert,
    validate_topk_ids,
)


def test_expert_range_is_contiguous_and_checked() -> None:
    assert [expert_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert expert_range(6, 1, 0) == (0, 6)
    with pytest.raises(ValueError, match="not divisible by the expert-parallel size 4"):
        expert_range(6, 4, 0)
    with pytest.raises(ValueError, match="outside"):
        expert_range(8, 4, 4)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 12),
    top_k=st.integers(1, 3),
    experts=st.integers(3, 6),
    seed=st.integers(0, 10_000),
)
def test_sort_by_expert_matches_brute_force(
    tokens: int, top_k: int, experts: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, experts, (tokens, top_k), generator=g)
    slots, counts = sort_by_expert(ids, experts)
    flat = ids.reshape(-1).tolist()
    want = sorted((e, i) for i, e in enumerate(flat) if e >= 0)
    assert slots.tolist() == [i for _, i in want]
    assert counts.tolist() == [sum(1 for e in flat if e == x) for x in range(experts)]
    assert torch.equal(expert_load(ids, experts), counts)


@settings(max_examples=40, deadline=None)
@given(
    sources=st.integers(1, 4),
    local=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
def test_group_major_to_expert_major_matches_brute_force(
    sources: int, local: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (sources, local), generator=g)
    # Label each received row with (source, expert), laid out source-major.
    labels = [(w, e) for w in range(sources) for e in range(local) for _ in range(counts[w, e])]
    index = group_major_to_expert_major(counts)
    got = [labels[i] for i in index.tolist()]
    assert got == sorted(labels, key=lambda we: (we[1], we[0]))
    if index.numel():
        inv = inverse_permutation(index)
        assert torch.equal(index[inv], torch.arange(index.numel()))


def test_validate_topk_ids_names_the_bad_value() -> None:
    validate_topk_ids(torch.tensor([[0, -1], [3, 2]]), 4)
    with pytest.raises(ValueError, match="expert id 4, outside"):
        validate_topk_ids(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match="expert id -2"):
        validate_topk_ids(torch.tensor([[-2, 1]]), 4)


def test_dispatch_rejects_bad_shapes() -> None:
    d = LocalDispatcher(4)
    h = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"must be \[T, K\] with T=3"):
        d.dispatch(h, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="topk_weights shape"):
        d.dispatch(h, torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 1))
    with pytest.raises(TypeError, match="integer"):
        d.dispatch(h, torch.zeros(3, 2), torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        d.dispatch(h[None], torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))


def test_local_dispatch_combine_gradients_match_finite_differences() -> None:
    """gradcheck through dispatch -> per-expert linear map -> combine, float64."""
    g = torch.Generator().manual_seed(0)
    experts, hidden_size = 3, 4
    ids = torch.tensor([[0, 2], [1, -1], [2, 0], [-1, -1], [1, 0]])
    mats = torch.randn(experts, hidden_size, hidden_size, generator=g, dtype=torch.float64)
    d = LocalDispatcher(experts)

    def fn(hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        x, counts, handle = d.dispatch(hidden, ids, weights)
        y = torch.cat([c @ mats[e] for e, c in enumerate(x.split(counts.tolist()))])
        return d.combine(y, handle)

    hidden = torch.randn(5, hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (hidden, weights))
    # The forward is the routing-weighted sum, computed densely.
    want = torch.zeros(5, hidden_size, dtype=torch.float64)
    for t in range(5):
        for k in range(2):
            if ids[t, k] >= 0:
                want[t] += weights[t, k] * (hidden[t] @ mats[ids[t, k]])
    torch.testing.assert_close(fn(hidden, weights), want, rtol=0, atol=1e-12)


def test_load_balancing_loss_ignores_padding_rows() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 4, generator=g, requires_grad=True)
    probs = torch.softmax(logits, -1)
    ids = torch.topk(probs, 2).indices
    real = load_balancing_loss(probs[:4], ids[:4])
    padded_ids = torch.cat([ids[:4], torch.full((2, 2), -1)])
    padded = load_balancing_loss(probs, padded_ids)
    torch.testing.assert_close(padded, real, rtol=0, atol=0)
    padded.backward()
    assert logits.grad is not None
    assert torch.equal(logits.grad[4:], torch.zeros(2, 4)), "padding rows got a gradient"
    assert logits.grad[:4].abs().sum() > 0
    # Uniform routing and uniform probabilities give exactly 1.
    uniform = torch.full((4, 4), 0.25)
    assert float(load_balancing_loss(uniform, torch.tensor([[0], [1], [2], [3]]))) == pytest.approx(
        1.0
    )


def test_dispatchers_satisfy_the_protocol() -> None:
    local = LocalDispatcher(4)
    assert isinstance(local, Dispatcher)
    wrapped = EqualizingDispatcher(local)
    assert isinstance(wrapped, Dispatcher)
    assert (wrapped.num_experts, wrapped.num_local_experts, wrapped.local_expert_start) == (4, 4, 0)
