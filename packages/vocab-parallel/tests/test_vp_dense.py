"""Dense (single-process) parity with the float64 reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

import _vp_reference as reference
import vocab_parallel as vp
from _vp_reference import IGNORE
from train_testing.reference import token_log_probs

SHAPE = (3, 5)
VOCAB = 97
MASKED = 11  # the first 11 vocabulary columns are -inf; labels avoid them

# (value atol, grad atol, grad rtol) per input dtype. bf16 gradients are rounded to bf16.
TOL = {
    torch.float32: (2e-5, 2e-6, 1e-5),
    torch.bfloat16: (5e-5, 4e-3, 1e-2),
    torch.float16: (5e-5, 1e-3, 2e-3),
}


def _close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, what: str):
    torch.testing.assert_close(
        actual.double(),
        expected,
        atol=atol,
        rtol=rtol,
        equal_nan=True,
        msg=lambda m: f"{what}: {m}",
    )


def _inputs(dtype: torch.dtype, seed: int, masked: int = MASKED):
    logits = reference.make_logits(SHAPE, VOCAB, seed=seed, masked_columns=masked).to(dtype)
    labels = reference.make_labels(SHAPE, VOCAB, seed=seed, low=masked, ignore_index=IGNORE)
    ours = logits.clone().requires_grad_()
    ref = logits.double().requires_grad_()
    return ours, ref, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_log_probs_matches_reference(dtype: torch.dtype, temperature: float) -> None:
    ours, ref, labels = _inputs(dtype, seed=1)
    assert (labels == IGNORE).any() and (labels != IGNORE).any()
    out = vp.token_log_probs(ours, labels, temperature=temperature, chunk_size=4)
    expected = token_log_probs(ref, labels, temperature=temperature)
    assert out.dtype == torch.float32 and out.shape == SHAPE
    v_atol, g_atol, g_rtol = TOL[dtype]
    _close(out, expected, atol=v_atol, rtol=1e-5, what="log-probs")
    assert torch.all(out[labels == IGNORE] == 0)
    weights = reference.upstream(SHAPE, seed=1)
    (out.double() * weights).sum().backward()
    (expected * weights).sum().backward()
    assert ours.grad is not None and ours.grad.dtype == dtype
    _close(ours.grad, ref.grad, atol=g_atol, rtol=g_rtol, what="log-prob gradient")
    assert torch.all(ours.grad[labels == IGNORE] == 0), "ignored rows must get zero gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 1.6])
def test_token_entropy_matches_reference(dtype: torch.dtype, temperature: float) -> None:
    ours, ref, _ = _inputs(dtype, seed=2)
    out = vp.token_entropy(ours, temperature=temperature, chunk_size=2)
    expected = reference.ref_entropy(ref, temperature)
    v_atol, g_atol, g_rtol = TOL[dtype]
    _close(out, expected, atol=v_atol, rtol=1e-5, what="entropy")
    assert torch.all(out >= 0)
    weights = reference.upstream(SHAPE, seed=2)
    (out.double() * weights).sum().backward()
    (expected * weights).sum().backward()
    _close(ours.grad, ref.grad, atol=g_atol, rtol=g_rtol, what="entropy gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_and_entropy_share_one_pass(dtype: torch.dtype) -> None:
    ours, ref, labels = _inputs(dtype, seed=3)
    log_p, ent = vp.token_log_probs_and_entropy(ours, labels, temperature=0.9, chunk_size=3)
    ref_lp = token_log_probs(ref, labels, temperature=0.9)
    ref_h = reference.ref_entropy(ref, 0.9)
    v_atol, g_atol, g_rtol = TOL[dtype]
    _close(log_p, ref_lp, atol=v_atol, rtol=1e-5, what="log-probs")
    _close(ent, ref_h, atol=v_atol, rtol=1e-5, what="entropy")
    w1, w2 = reference.upstream(SHAPE, seed=30), reference.upstream(SHAPE, seed=31)
    (log_p.double() * w1 + ent.double() * w2).sum().backward()
    (ref_lp * w1 + ref_h * w2).sum().backward()
    _close(ours.grad, ref.grad, atol=g_atol, rtol=g_rtol, what="joint gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_cross_entropy_matches_torch(dtype: torch.dtype, reduction: str, label_smoothing: float):
    # No masked columns here: with label smoothing a -inf logit makes both losses infinite.
    ours, ref, labels = _inputs(dtype, seed=4, masked=0)
    out = vp.cross_entropy(
        ours, labels, reduction=reduction, label_smoothing=label_smoothing, chunk_size=5
    )
    expected = reference.ref_cross_entropy(ref, labels, IGNORE, reduction, label_smoothing)
    assert out.shape == expected.shape
    v_atol, g_atol, g_rtol = TOL[dtype]
    _close(out, expected, atol=v_atol, rtol=1e-5, what="cross-entropy")
    weights = reference.upstream(tuple(expected.shape), seed=4)
    (out.double() * weights).sum().backward()
    (expected * weights).sum().backward()
    _close(ours.grad, ref.grad, atol=g_atol, rtol=g_rtol, what="cross-entropy gradient")


def test_cross_entropy_with_masked_vocabulary() -> None:
    ours, ref, labels = _inputs(torch.float32, seed=5)
    out = vp.cross_entropy(ours, labels)
    expected = reference.ref_cross_entropy(ref, labels, IGNORE, "mean", 0.0)
    _close(out, expected, atol=2e-5, rtol=1e-5, what="masked cross-entropy")
    out.backward()
    expected.backward()
    _close(ours.grad, ref.grad, atol=2e-6, rtol=1e-5, what="masked cross-entropy gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 1, 7])
def test_linear_token_log_probs_matches_reference(dtype: torch.dtype, chunk_size: int | None):
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(*SHAPE, 16, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, 16, generator=gen) * 0.5).to(dtype)
    labels = reference.make_labels(SHAPE, VOCAB, seed=6, ignore_index=IGNORE)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    out = vp.linear_token_log_probs(h, w, labels, temperature=1.3, chunk_size=chunk_size)
    expected = token_log_probs(hd @ wd.T, labels, temperature=1.3)
    # bf16: our logits are bf16 matmul outputs (as in `hidden @ weight.T`), the reference's exact.
    v_atol, g_atol = (1e-5, 1e-5) if dtype == torch.float32 else (0.1, 0.1)
    _close(out, expected, atol=v_atol, rtol=1e-4, what="linear log-probs")
    weights = reference.upstream(SHAPE, seed=6)
    (out.double() * weights).sum().backward()
    (expected * weights).sum().backward()
    _close(h.grad, hd.grad, atol=g_atol, rtol=1e-2, what="hidden gradient")
    _close(w.grad, wd.grad, atol=g_atol, rtol=1e-2, what="weight gradient")
    assert torch.all(h.grad[labels == IGNORE] == 0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_linear_log_probs_skip_ignored_forms_only_trained_rows(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``skip_ignored`` (the default) sends only the labelled tokens through the forward and
    the recomputing backward, with the log-probs and gradients of forming every token, 0 and
    a zero hidden gradient at the ignored positions; ``trained_count`` avoids torch.nonzero."""
    from vocab_parallel import _linear

    if backend == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available():
            pytest.skip("the Triton backend runs on CUDA; its CPU twin is the torch case")
    device = "cuda" if backend == "triton" else "cpu"
    dtype = torch.bfloat16 if backend == "triton" else torch.float32
    shape = (4, 9)
    gen = torch.Generator().manual_seed(16)
    hidden = torch.randn(*shape, 16, generator=gen).to(device, dtype)
    weight = (torch.randn(VOCAB, 16, generator=gen) * 0.5).to(device, dtype)
    labels = reference.make_labels(shape, VOCAB, seed=16, ignore_fraction=0.5).to(device)
    valid = labels != IGNORE
    trained = int(valid.sum())
    assert 0 < trained < labels.numel()  # the test can fail: some tokens are ignored, some not
    coef = reference.upstream(shape, seed=16).to(device)
    forward_rows: list[int] = []
    backward_rows: list[int] = []
    stats, grad = _linear._blockwise_stats, _linear._chunk_logits_grad

    def count_forward(h: torch.Tensor, *args: object, **kw: object):  # type: ignore[no-untyped-def]
        forward_rows.append(h.shape[0])
        return stats(h, *args, **kw)  # type: ignore[arg-type]

    def count_backward(logits: torch.Tensor, *args: object, **kw: object):  # type: ignore[no-untyped-def]
        backward_rows.append(logits.shape[0])
        return grad(logits, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_linear, "_blockwise_stats", count_forward)
    monkeypatch.setattr(_linear, "_chunk_logits_grad", count_backward)

    def run(**options: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        forward_rows.clear()
        backward_rows.clear()
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        out = vp.linear_token_log_probs(
            h,
            w,
            labels,
            temperature=1.3,
            chunk_size=20,
            backend=backend,
            **options,  # type: ignore[arg-type]
        )
        (out.double() * coef).sum().backward()
        assert h.grad is not None and w.grad is not None
        return out.detach(), h.grad, w.grad

    every = run(skip_ignored=False)
    assert forward_rows == [labels.numel()] and set(backward_rows) == {labels.numel()}
    skipped = run()
    assert forward_rows == [trained] and set(backward_rows) == {trained}, backward_rows
    monkeypatch.setattr(torch, "nonzero", lambda *a, **kw: pytest.fail("torch.nonzero ran"))
    counted = run(trained_count=trained, validate=True)
    assert forward_rows == [trained]
    for got in (skipped, counted):
        for a, b in zip(got, every, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not skipped[0][~valid].any() and not skipped[1][~valid].any()
    if dtype == torch.float32:  # and against the float64 reference, computed unfused
        hd = hidden.double().requires_grad_()
        wd = weight.double().requires_grad_()
        expected = token_log_probs(hd @ wd.T, labels, temperature=1.3)
        (expected * coef).sum().backward()
        _close(skipped[0], expected, atol=1e-5, rtol=1e-4, what="skipped log-probs")
        _close(skipped[1], hd.grad, atol=1e-5, rtol=1e-4, what="skipped hidden gradient")
        _close(skipped[2], wd.grad, atol=1e-5, rtol=1e-4, what="skipped weight gradient")


def test_linear_log_probs_all_ignored_and_trained_count_errors() -> None:
    gen = torch.Generator().manual_seed(17)
    hidden = torch.randn(*SHAPE, 8, generator=gen).requires_grad_()
    weight = torch.randn(VOCAB, 8, generator=gen).requires_grad_()
    labels = torch.full(SHAPE, IGNORE)
    for count in (None, 0):  # no trained token: nothing formed, zeros and zero gradients
        out = vp.linear_token_log_probs(hidden, weight, labels, trained_count=count)
        assert out.shape == SHAPE and not out.any()
        out.sum().backward()
        assert hidden.grad is not None and weight.grad is not None
        assert not hidden.grad.any() and not weight.grad.any()
        hidden.grad = weight.grad = None
    labels = reference.make_labels(SHAPE, VOCAB, seed=17)
    trained = int((labels != IGNORE).sum())
    with pytest.raises(ValueError, match=rf"outside \[0, {labels.numel()}\]"):
        vp.linear_token_log_probs(hidden, weight, labels, trained_count=labels.numel() + 1)
    with pytest.raises(ValueError, match=f"trained_count={trained - 1}, but {trained} labels"):
        vp.linear_token_log_probs(hidden, weight, labels, trained_count=trained - 1, validate=True)


def test_linear_matches_unfused_logits_bitwise_close() -> None:
    """Same bf16 logits as `hidden @ weight.T`: the fused form equals token_log_probs on them."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(4, 32, generator=gen).bfloat16()
    weight = torch.randn(VOCAB, 32, generator=gen).bfloat16()
    labels = reference.make_labels((4,), VOCAB, seed=7)
    fused = vp.linear_token_log_probs(hidden, weight, labels, chunk_size=10)
    plain = vp.token_log_probs(hidden @ weight.T, labels)
    torch.testing.assert_close(fused, plain, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_unchunked(dtype: torch.dtype) -> None:
    logits = reference.make_logits(SHAPE, VOCAB, seed=8, masked_columns=3).to(dtype)
    labels = reference.make_labels(SHAPE, VOCAB, seed=8, low=3)
    weights = reference.upstream(SHAPE, seed=8).float()

    def run(chunk: int | None):
        x = logits.clone().requires_grad_()
        lp, h = vp.token_log_probs_and_entropy(x, labels, temperature=0.8, chunk_size=chunk)
        ce = vp.cross_entropy(x, labels, label_smoothing=0.1, chunk_size=chunk)
        ((lp + h) * weights).sum().add(ce).backward()
        return lp, h, ce, x.grad

    base = run(None)
    for chunk in (1, 4, 15, 1000):
        for a, b in zip(run(chunk), base, strict=True):
            assert torch.equal(a, b), f"chunk_size={chunk} changed a result"


def test_all_ignored_batch() -> None:
    logits = reference.make_logits(SHAPE, VOCAB, seed=9).requires_grad_()
    labels = torch.full(SHAPE, IGNORE)
    out = vp.token_log_probs(logits, labels)
    assert torch.all(out == 0)
    out.sum().backward()
    assert logits.grad is not None and torch.all(logits.grad == 0)
    # PyTorch's mean over zero targets is nan (0/0); the sum is 0.
    assert torch.isnan(vp.cross_entropy(logits, labels))
    assert torch.isnan(reference.ref_cross_entropy(logits.double(), labels, IGNORE, "mean", 0.0))
    assert vp.cross_entropy(logits, labels, reduction="sum").item() == 0.0


def test_inputs_are_not_modified_and_no_fp32_copy_is_saved() -> None:
    logits = reference.make_logits((64,), 512, seed=10).bfloat16().requires_grad_()
    before = logits.detach().clone()
    labels = reference.make_labels((64,), 512, seed=10)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, h = vp.token_log_probs_and_entropy(logits, labels, chunk_size=8)
    (lp + h).sum().backward()
    assert torch.equal(logits.detach(), before)
    big = [(t.dtype, tuple(t.shape)) for t in saved if t.numel() >= logits.numel()]
    # Only the input logits themselves (bf16) may be saved at logits size.
    assert big == [(torch.bfloat16, (1, 64, 512))], big
    fp32 = reference.make_logits((8,), 50, seed=11).requires_grad_()
    snapshot = fp32.detach().clone()
    vp.token_entropy(fp32, temperature=0.5).sum().backward()
    assert torch.equal(fp32.detach(), snapshot), "fp32 logits were modified in place"


def test_empty_batch() -> None:
    logits = torch.randn(0, 10, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long)
    out = vp.token_log_probs(logits, labels)
    assert out.shape == (0,)
    out.sum().backward()
    assert logits.grad is not None and logits.grad.shape == (0, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_logits_are_read_in_place(dtype: torch.dtype) -> None:
    """logits[:, :-1] (the usual shift) is neither copied nor saved as a copy."""
    full = (
        reference.make_logits((3, 6), VOCAB, seed=12, masked_columns=2).to(dtype).requires_grad_()
    )
    labels = reference.make_labels((3, 5), VOCAB, seed=12, low=2)
    ref_full = full.detach().double().requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        log_p, ent = vp.token_log_probs_and_entropy(full[:, :-1], labels, chunk_size=2)
    big = [t for t in saved if t.numel() >= 3 * 5 * VOCAB]
    assert len(big) == 1, [tuple(t.shape) for t in big]
    assert big[0].untyped_storage().data_ptr() == full.untyped_storage().data_ptr(), "copied"
    ref_lp = token_log_probs(ref_full[:, :-1], labels)
    ref_h = reference.ref_entropy(ref_full[:, :-1], 1.0)
    v_atol, g_atol, g_rtol = TOL[dtype]
    _close(log_p, ref_lp, atol=v_atol, rtol=1e-5, what="sliced log-probs")
    _close(ent, ref_h, atol=v_atol, rtol=1e-5, what="sliced entropy")
    w1, w2 = reference.upstream((3, 5), seed=12), reference.upstream((3, 5), seed=13)
    (log_p.double() * w1 + ent.double() * w2).sum().backward()
    (ref_lp * w1 + ref_h * w2).sum().backward()
    _close(full.grad, ref_full.grad, atol=g_atol, rtol=g_rtol, what="sliced gradient")
    assert torch.all(full.grad[:, -1] == 0)
