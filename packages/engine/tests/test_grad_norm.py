"""global_grad_norm / clip_grads_with_norm_ on plain tensors vs float64 and torch references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from train_engine import clip_grads_with_norm_, global_grad_norm


def _params(shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        p = torch.zeros(shape, dtype=dtype, requires_grad=True)
        p.grad = (torch.randn(shape, generator=g) * 3).to(dtype)
        out.append(p)
    return out


shapes_st = st.lists(
    st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple), min_size=1, max_size=6
)


@settings(max_examples=25, deadline=None)
@given(shapes=shapes_st, seed=st.integers(0, 10_000), p=st.sampled_from([1.0, 2.0, 3.0, math.inf]))
def test_norm_matches_float64_reference(shapes, seed: int, p: float) -> None:
    params = _params(shapes, seed, torch.float32)
    flat = torch.cat([q.grad.double().reshape(-1) for q in params])
    expected = flat.abs().max() if math.isinf(p) else flat.abs().pow(p).sum().pow(1 / p)
    for fast in (True, False):
        got = global_grad_norm(params, p, fast_path=fast)
        assert got.dtype == torch.float64
        assert float(got) == pytest.approx(float(expected), rel=1e-6)


@settings(max_examples=15, deadline=None)
@given(shapes=shapes_st, seed=st.integers(0, 10_000), max_norm=st.floats(0.01, 50.0))
def test_clip_matches_torch_clip_grad_norm(shapes, seed: int, max_norm: float) -> None:
    ours = _params(shapes, seed, torch.float32)
    theirs = _params(shapes, seed, torch.float32)
    norm = global_grad_norm(ours)
    coef = clip_grads_with_norm_(ours, max_norm, norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-5)
    assert 0 < float(coef) <= 1
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_mixed_dtypes_and_missing_grads() -> None:
    params = _params([(4, 3), (5,)], 0, torch.float32) + _params([(6,)], 1, torch.bfloat16)
    params.append(torch.zeros(3, requires_grad=True))  # no grad: ignored
    flat = torch.cat([q.grad.double().reshape(-1) for q in params if q.grad is not None])
    assert float(global_grad_norm(params)) == pytest.approx(float(flat.norm()), rel=1e-6)
    assert float(global_grad_norm([])) == 0.0


def test_argument_errors() -> None:
    params = _params([(3,)], 0, torch.float32)
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        global_grad_norm(params, 0)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_grads_with_norm_(params, 0.0, torch.tensor(1.0))


def test_fallback_without_float64_foreach_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    params = _params([(4, 3), (5,)], 3, torch.float32)
    expected = float(global_grad_norm(params))

    def unsupported(*args, **kwargs):
        raise RuntimeError("no float64 output on this backend")

    monkeypatch.setattr(torch, "_foreach_norm", unsupported)
    assert float(global_grad_norm(params)) == pytest.approx(expected, rel=1e-12)


def test_cpu_blocked_2_norm_is_float64_accurate() -> None:
    # Tensors longer than one block, with a ragged tail, where a plain float32 sum over 10^6
    # squares would be off by ~1e-5 relative.
    g = torch.Generator().manual_seed(7)
    params = []
    for n in (1_000_003, 4096, 17):
        q = torch.zeros(n, requires_grad=True)
        q.grad = torch.randn(n, generator=g) * 3 + 1
        params.append(q)
    bf16 = torch.zeros(9000, dtype=torch.bfloat16, requires_grad=True)
    bf16.grad = torch.randn(9000, generator=g).to(torch.bfloat16)
    params.append(bf16)
    flat = torch.cat([q.grad.double().reshape(-1) for q in params])
    assert float(global_grad_norm(params)) == pytest.approx(float(flat.norm()), rel=1e-8)
    # Plain float32 accumulation over the same gradients is measurably worse: the test can fail.
    fp32 = torch.stack(torch._foreach_norm([q.grad.float() for q in params])).norm()
    assert abs(float(fp32) / float(flat.norm()) - 1) > 1e-7


def test_cpu_blocked_path_keeps_huge_finite_gradients_finite() -> None:
    # 1e30 squared overflows float32 block sums; the float64 redo keeps the norm exact.
    q = torch.zeros(5000, requires_grad=True)
    q.grad = torch.full((5000,), 1e30)
    expected = float(q.grad.double().norm())
    assert float(global_grad_norm([q])) == pytest.approx(expected, rel=1e-12)
    q.grad[3] = float("inf")
    assert math.isinf(float(global_grad_norm([q])))
    q.grad[3] = float("nan")
    assert math.isnan(float(global_grad_norm([q])))
