"""Property-based checks over shapes, vocabulary sizes, chunking and shard counts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import vocab_parallel as vp
from _vp_reference import make_labels, make_logits, ref_entropy, upstream
from _vp_workers import check_logits_parity
from train_testing.reference import token_log_probs

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple)
seeds = st.integers(0, 2**16)
# The linear and sharded checks' temperatures (the dense logits check takes a wider range).
temperatures = st.floats(0.5, 2.0)


@settings(max_examples=30, deadline=None)
@given(
    shape=shapes,
    vocab=st.integers(1, 40),
    masked_share=st.floats(0.0, 0.9),
    temperature=st.floats(0.3, 3.0),
    chunk_size=st.one_of(st.none(), st.integers(1, 5)),
    seed=seeds,
)
def test_dense_log_probs_and_entropy_match_reference(
    shape: tuple[int, ...],
    vocab: int,
    masked_share: float,
    temperature: float,
    chunk_size: int | None,
    seed: int,
) -> None:
    masked = min(int(vocab * masked_share), vocab - 1)
    logits = make_logits(shape, vocab, seed=seed, masked_columns=masked)
    labels = make_labels(shape, vocab, seed=seed, low=masked)
    x = logits.clone().requires_grad_()
    ref = logits.double().requires_grad_()
    log_p, ent = vp.token_log_probs_and_entropy(
        x, labels, temperature=temperature, chunk_size=chunk_size
    )
    ref_lp = token_log_probs(ref, labels, temperature=temperature)
    ref_h = ref_entropy(ref, temperature)
    torch.testing.assert_close(log_p.double(), ref_lp, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_h, atol=5e-5, rtol=1e-5)
    w1, w2 = upstream(shape, seed=seed), upstream(shape, seed=seed + 1)
    (log_p.double() * w1 + ent.double() * w2).sum().backward()
    (ref_lp * w1 + ref_h * w2).sum().backward()
    assert x.grad is not None and ref.grad is not None
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=2e-5, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(
    tokens=st.integers(1, 6),
    vocab=st.integers(1, 30),
    hidden=st.integers(1, 6),
    temperature=temperatures,
    chunk_size=st.one_of(st.none(), st.integers(1, 7)),
    seed=seeds,
)
def test_dense_linear_matches_reference(
    tokens: int, vocab: int, hidden: int, temperature: float, chunk_size: int | None, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=gen, requires_grad=True)
    labels = make_labels((tokens,), vocab, seed=seed)
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    out = vp.linear_token_log_probs(h, w, labels, temperature=temperature, chunk_size=chunk_size)
    ref = token_log_probs(hd @ wd.T, labels, temperature=temperature)
    torch.testing.assert_close(out.double(), ref, atol=5e-5, rtol=1e-5)
    weights = upstream((tokens,), seed=seed)
    (out.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    assert h.grad is not None and w.grad is not None
    torch.testing.assert_close(h.grad.double(), hd.grad, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(w.grad.double(), wd.grad, atol=5e-5, rtol=1e-4)


# (mesh shape, vocabulary mesh dim): 1, 2 or 4 vocabulary shards on 4 ranks.
LAYOUTS = [((4,), None), ((2, 2), 0), ((2, 2), 1), ((4,), 0)]


@pytest.mark.timeout(240)
@settings(
    max_examples=12,
    deadline=None,
    # No shrinking: every failing example restarts the rank pool, which makes shrinking take
    # many minutes; the failing case is printed in full by the ranks' assertion messages.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    layout=st.sampled_from(LAYOUTS),
    shape=st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple),
    vocab=st.integers(1, 30),
    temperature=temperatures,
    seed=seeds,
)
def test_sharded_matches_reference_for_any_layout(
    rank_pool, layout, shape: tuple[int, ...], vocab: int, temperature: float, seed: int
) -> None:
    mesh, vocab_mesh_dim = layout
    case = {
        "vocab": vocab,
        "mesh": mesh,
        "vocab_mesh_dim": vocab_mesh_dim,
        "dtype": "float32",
        "shape": shape,
        "temperature": temperature,
        "seed": seed,
    }
    results = rank_pool.run(4, check_logits_parity, [case], timeout_s=150)
    assert all(len(r) == 1 for r in results)
