"""The grads-in-forward fused linear losses and the in-place logits option vs float64 references
(plain log_softmax + gather over the full dense logits), forward and backward."""

from __future__ import annotations

import zlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vocab_parallel as vp
from _vp_reference import (
    IGNORE,
    LINEAR_SHAPE,
    LINEAR_VOCAB,
    linear_case,
    make_labels,
    make_logits,
    upstream,
)
from train_testing.reference import relative_error, token_log_probs
from vocab_parallel._fused_linear import accumulate_weight_grad_, fused_chunk_tokens


def _reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    coefficients: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, hidden grad, weight grad) in float64 from the same (rounded) inputs."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    log_p = token_log_probs(h @ w.T, labels, temperature=temperature)
    loss = (coefficients.double() * log_p).sum()
    grad_h, grad_w = torch.autograd.grad(loss, [h, w])
    return loss.detach(), grad_h, grad_w


# Relative (norm) error allowed, by (dtype, fp32_logits, fp32_weight_grad). With fp32 logits and
# an fp32 weight-gradient sum what remains is the rounding of the gradients to bf16 (about
# 1.7e-3); bf16 logits (the default, as any matmul returns them) add the logits' rounding, a
# bf16 weight-gradient sum the rounding of every chunk's partial sum.
TOL = {
    ("float32", False, True): 2e-6,
    ("bfloat16", True, True): 4e-3,
    # bf16 logits: the unfused matmul + log_softmax itself reaches 7.7e-3 on these inputs (max
    # over 60 seeds, temperature 0.7), the fused form 7.9e-3.
    ("bfloat16", False, True): 1e-2,
    ("bfloat16", False, False): 1.5e-2,
}


@pytest.mark.parametrize("mode", ["sum", "mean", "coefficients"])
@pytest.mark.parametrize(("dtype_name", "fp32_logits", "fp32_weight_grad"), list(TOL))
@pytest.mark.parametrize(("temperature", "chunk_size"), [(1.0, None), (0.7, 7)])
def test_fused_loss_matches_float64(
    mode: str,
    dtype_name: str,
    fp32_logits: bool,
    fp32_weight_grad: bool,
    temperature: float,
    chunk_size: int | None,
) -> None:
    dtype = getattr(torch, dtype_name)
    exact = fp32_logits or dtype == torch.float32
    # A fixed seed per case (hash() of a str is randomised per process).
    seed = zlib.crc32(repr((mode, dtype_name, fp32_logits, fp32_weight_grad, temperature)).encode())
    seed %= 1000
    hidden, weight, labels = linear_case(dtype, seed)
    valid = labels != IGNORE
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    options = {
        "temperature": temperature,
        "chunk_size": chunk_size,
        "fp32_logits": fp32_logits,
        "fp32_weight_grad": fp32_weight_grad,
    }
    if mode == "coefficients":
        coef = upstream(LINEAR_SHAPE, seed=seed).float()
        loss = vp.fused_linear_token_loss(h, w, labels, coef, **options)
    else:
        coef = -torch.ones(LINEAR_SHAPE, dtype=torch.float64)
        if mode == "mean":
            coef = coef / valid.sum()
        loss = vp.linear_cross_entropy(h, w, labels, reduction=mode, **options)  # type: ignore[arg-type]
    ref_loss, ref_h, ref_w = _reference(hidden, weight, labels, coef, temperature)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    # bf16 logits (as hidden @ weight.T returns them) are each off by up to |z| * 2^-9, and the
    # loss sums such errors of its target logits: about 1% here, as for the unfused form.
    value_tol = 1e-6 if dtype == torch.float32 else (2e-4 if exact else 2e-2)
    assert abs(loss.item() - ref_loss.item()) <= value_tol * max(1.0, abs(ref_loss.item()))
    (loss * 1.5).backward()  # backward scales the stored gradients by the upstream gradient
    assert h.grad is not None and w.grad is not None
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    tol = TOL[dtype_name, fp32_logits, fp32_weight_grad]
    assert relative_error(h.grad, 1.5 * ref_h) <= tol, relative_error(h.grad, 1.5 * ref_h)
    assert relative_error(w.grad, 1.5 * ref_w) <= tol, relative_error(w.grad, 1.5 * ref_w)
    assert torch.equal(h.grad[~valid], torch.zeros_like(h.grad[~valid]))


def test_log_probs_returned_match_reference_and_recompute_form() -> None:
    hidden, weight, labels = linear_case(torch.float32, 3)
    loss, log_p = vp.fused_linear_token_loss(
        hidden, weight, labels, 1.0, temperature=0.8, return_log_probs=True
    )
    ref = token_log_probs(hidden.double() @ weight.double().T, labels, temperature=0.8)
    torch.testing.assert_close(log_p.double(), ref, atol=2e-5, rtol=1e-5)
    recompute = vp.linear_token_log_probs(hidden, weight, labels, temperature=0.8)
    torch.testing.assert_close(log_p, recompute, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, log_p.sum())


def test_chunking_leaves_results_unchanged_in_fp32() -> None:
    hidden, weight, labels = linear_case(torch.float32, 4)
    results = []
    for chunk_size in (1, 5, 33, 1000):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        vp.linear_cross_entropy(h, w, labels, chunk_size=chunk_size).backward()
        results.append((h.grad, w.grad))
    for grad_h, grad_w in results[1:]:
        torch.testing.assert_close(grad_h, results[0][0], atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(grad_w, results[0][1], atol=1e-7, rtol=1e-6)


def test_gradient_accumulation_over_two_calls() -> None:
    hidden, weight, labels = linear_case(torch.float32, 5)
    hidden2, _, labels2 = linear_case(torch.float32, 6)
    w = weight.clone().requires_grad_()
    h1, h2 = hidden.clone().requires_grad_(), hidden2.clone().requires_grad_()
    vp.linear_cross_entropy(h1, w, labels, reduction="sum", chunk_size=8).backward()
    (vp.linear_cross_entropy(h2, w, labels2, reduction="sum") / 4).backward()
    coef = -torch.ones(LINEAR_SHAPE, dtype=torch.float64)
    _, ref_h1, ref_w1 = _reference(hidden, weight, labels, coef, 1.0)
    _, ref_h2, ref_w2 = _reference(hidden2, weight, labels2, coef / 4, 1.0)
    assert w.grad is not None and h1.grad is not None and h2.grad is not None
    assert relative_error(w.grad, ref_w1 + ref_w2) <= 2e-6
    assert relative_error(h1.grad, ref_h1) <= 2e-6 and relative_error(h2.grad, ref_h2) <= 2e-6


def test_frozen_weight_gets_no_gradient_and_hidden_is_exact() -> None:
    hidden, weight, labels = linear_case(torch.float32, 7)
    h = hidden.clone().requires_grad_()
    loss = vp.linear_cross_entropy(h, weight, labels)  # weight.requires_grad is False (LoRA)
    loss.backward()
    coef = -torch.ones(LINEAR_SHAPE, dtype=torch.float64) / (labels != IGNORE).sum()
    _, ref_h, _ = _reference(hidden, weight, labels, coef, 1.0)
    assert weight.grad is None and h.grad is not None
    assert relative_error(h.grad, ref_h) <= 2e-6


def test_no_grad_forward_gives_the_loss_only() -> None:
    hidden, weight, labels = linear_case(torch.float32, 8)
    with torch.no_grad():
        loss = vp.linear_cross_entropy(hidden.requires_grad_(), weight, labels)
    coef = -torch.ones(LINEAR_SHAPE, dtype=torch.float64) / (labels != IGNORE).sum()
    ref_loss, _, _ = _reference(hidden, weight, labels, coef, 1.0)
    assert not loss.requires_grad
    assert abs(loss.item() - ref_loss.item()) <= 1e-5


def test_all_ignored_mean_is_nan_with_zero_gradients() -> None:
    hidden, weight, _ = linear_case(torch.float32, 9)
    labels = torch.full(LINEAR_SHAPE, IGNORE)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = vp.linear_cross_entropy(h, w, labels)
    assert torch.isnan(loss)
    loss.backward()
    assert h.grad is not None and w.grad is not None
    assert not h.grad.any() and not w.grad.any()


def test_misuse_errors() -> None:
    hidden, weight, labels = linear_case(torch.float32, 10)
    h = hidden.clone().requires_grad_()
    loss = vp.linear_cross_entropy(h, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    coef = torch.ones(LINEAR_SHAPE, requires_grad=True)
    with pytest.raises(ValueError, match="detach"):
        vp.fused_linear_token_loss(hidden, weight, labels, coef)
    with pytest.raises(ValueError, match="one per token"):
        vp.fused_linear_token_loss(hidden, weight, labels, torch.ones(5))
    with pytest.raises(ValueError, match="linear_token_log_probs"):
        vp.linear_cross_entropy(hidden, weight, labels, reduction="none")  # type: ignore[arg-type]
    bad = labels.clone()
    bad[0, 0] = LINEAR_VOCAB
    with pytest.raises(ValueError, match="outside"):
        vp.linear_cross_entropy(hidden, weight, bad, validate=True)


def test_default_chunk_is_a_small_fraction_of_the_logits() -> None:
    # At most 1/20 of the tokens for large N (a multiple of 64), never more than N.
    assert fused_chunk_tokens(8192, 151936) == 384
    assert fused_chunk_tokens(16384, 151936) == 768
    assert fused_chunk_tokens(10, 151936) == 10
    assert fused_chunk_tokens(1_000_000, 1000) * 1000 <= 1_000_000 * 1000 / 20
    # Small N: at least 4M logits per chunk, so the matmuls are not cut too thin.
    assert fused_chunk_tokens(2048, 1000) == 2048 and fused_chunk_tokens(8192, 1000) == 4160
    # An fp32 weight-gradient accumulator of H columns: at least H / 2 tokens, so that the
    # chunk holds at most a quarter of the accumulator's bytes.
    for tokens, hidden in ((8192, 4096), (16384, 4096), (16384, 1536)):
        rows = fused_chunk_tokens(tokens, 151936, fp32_accumulator_width=hidden)
        assert rows == max(hidden // 2 // 64 * 64, fused_chunk_tokens(tokens, 151936)), rows
        assert rows * 151936 * 2 <= 151936 * hidden * 4 / 4 or rows == fused_chunk_tokens(
            tokens, 151936
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [34, 33])
def test_weight_gradient_accumulation_in_vocabulary_halves_adds_the_chunk(
    dtype: torch.dtype, vocab: int
) -> None:
    # The two-halves batched form (what CUDA runs for 16-bit accumulators) and the plain one
    # both add grad_logits.T @ h_chunk; an odd vocabulary falls back to the plain form.
    gen = torch.Generator().manual_seed(vocab)
    grad_logits = torch.randn(12, vocab, generator=gen).to(dtype)
    h_chunk = torch.randn(12, 8, generator=gen).to(dtype)
    start = torch.randn(vocab, 8, generator=gen).to(dtype)
    want = start.double() + grad_logits.double().T @ h_chunk.double()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    for halves in (True, False):
        accumulator = start.clone()
        accumulate_weight_grad_(accumulator, grad_logits, h_chunk, halves=halves)
        error = (accumulator.double() - want).abs() / want.abs().clamp(min=1.0)
        assert error.max() <= tolerance, (halves, float(error.max()))


class _NewStorages(TorchDispatchMode):
    """Bytes of every storage that an op output did not share with a known tensor."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.known.add(t.untyped_storage().data_ptr())
                self.sizes.append(t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("function", ["log_probs", "cross_entropy", "log_probs_and_entropy"])
def test_in_place_matches_out_of_place_without_a_logits_sized_buffer(
    dtype: torch.dtype, function: str
) -> None:
    shape, vocab, chunk = (4, 16), 256, 8
    base = make_logits(shape, vocab, seed=21).to(dtype)
    labels = make_labels(shape, vocab, seed=21, ignore_index=IGNORE)
    weights = upstream(shape, seed=21).float()

    def run(in_place: bool) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        logits = base.clone().requires_grad_()
        options = {"chunk_size": chunk, "in_place": in_place}
        if function == "log_probs":
            loss = (vp.token_log_probs(logits, labels, **options) * weights).sum()
        elif function == "cross_entropy":
            loss = vp.cross_entropy(logits, labels, **options)
        else:
            log_p, ent = vp.token_log_probs_and_entropy(logits, labels, **options)
            loss = (log_p * weights + ent).sum()
        with _NewStorages([logits]) as spy:
            loss.backward()
        assert logits.grad is not None
        return logits, logits.grad, spy.sizes

    _, expected, out_of_place_sizes = run(False)
    logits, grad, in_place_sizes = run(True)
    torch.testing.assert_close(grad, expected, atol=0, rtol=0)
    # The gradient lives in the logits' storage; backward allocates at most chunk buffers.
    assert grad.data_ptr() == logits.data_ptr()
    logits_bytes = base.numel() * base.element_size()
    assert max(out_of_place_sizes) >= logits_bytes  # the accounting sees a full gradient
    assert max(in_place_sizes) <= logits_bytes // 4, in_place_sizes


def test_in_place_backward_twice_raises_and_sliced_logits_are_written() -> None:
    base = make_logits((2, 5), 64, seed=22)
    labels = make_labels((2, 4), 64, seed=22, ignore_index=IGNORE)
    logits = base.clone().requires_grad_()
    log_p = vp.token_log_probs(logits[:, :-1], labels, in_place=True)
    log_p.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        log_p.sum().backward()
    ref = base.double().requires_grad_()
    token_log_probs(ref[:, :-1], labels).sum().backward()
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad.double(), ref.grad, atol=1e-6, rtol=1e-5)


def _bf16_rounding_floor(*grads: torch.Tensor) -> float:
    """The error of the float64 gradients rounded to bf16: no bf16 gradient can be closer."""
    return max(relative_error(g.to(torch.bfloat16), g) for g in grads)


@pytest.mark.parametrize("function", ["cross_entropy", "log_prob_loss", "recompute"])
@pytest.mark.parametrize("skip_ignored", [True, False])
def test_autocast_runs_in_its_dtype_and_returns_unrounded_fp32_gradients(
    function: str, skip_ignored: bool
) -> None:
    """fp32 master tensors under bf16 autocast (AMP loops, HF Trainer's bf16): the matmuls run
    in bf16 as autocast's would, so the loss equals the call on operands cast to bf16 by hand;
    the fp32 leaves get fp32 gradients that were never rounded to bf16, so they are closer to
    float64 (from the same bf16 operands) than the bf16 call's, and with fp32 logits closer
    than rounding the exact gradients to bf16 could be (the floor every bf16 gradient is at).
    The recompute form (``linear_token_log_probs``) too, in forward and in backward."""
    hidden, weight, labels = linear_case(torch.float32, 6)
    # Values a bf16 cast keeps: the float64 reference sees exactly the matmuls' operands.
    hidden, weight = hidden.bfloat16().float(), weight.bfloat16().float()

    def loss_of(h: torch.Tensor, w: torch.Tensor, **options: bool) -> torch.Tensor:
        if function == "cross_entropy":
            return vp.linear_cross_entropy(
                h, w, labels, reduction="sum", skip_ignored=skip_ignored, **options
            )
        if function == "recompute":  # no fp32_logits option: its blocks are never kept
            log_p = vp.linear_token_log_probs(h, w, labels, skip_ignored=skip_ignored)
            return -log_p.sum()
        return vp.fused_linear_log_prob_loss(
            h, w, labels, lambda log_p: -log_p, skip_ignored=skip_ignored, **options
        )

    ref_loss, ref_h, ref_w = _reference(hidden, weight, labels, -torch.ones(LINEAR_SHAPE), 1.0)
    floor = _bf16_rounding_floor(ref_h, ref_w)
    h16 = hidden.to(torch.bfloat16).requires_grad_()
    w16 = weight.to(torch.bfloat16).requires_grad_()
    by_hand = loss_of(h16, w16)
    by_hand.backward()
    assert h16.grad is not None and w16.grad is not None
    by_hand_err = max(relative_error(h16.grad, ref_h), relative_error(w16.grad, ref_w))
    assert by_hand_err >= floor  # a bf16 gradient: at least the rounding floor
    for fp32_logits in (False, True) if function != "recompute" else (False,):
        h32, w32 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(h32, w32, **({"fp32_logits": True} if fp32_logits else {}))
        loss.backward()
        assert h32.grad is not None and w32.grad is not None
        assert h32.grad.dtype == torch.float32 and w32.grad.dtype == torch.float32
        err = max(relative_error(h32.grad, ref_h), relative_error(w32.grad, ref_w))
        if not fp32_logits:
            torch.testing.assert_close(loss.float(), by_hand.float(), rtol=0, atol=0)
            assert err < 0.95 * by_hand_err, (err, by_hand_err)
        else:  # what is left is the logits gradient's rounding to bf16 before its matmuls
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
            assert err < 0.7 * floor, (err, floor)


@pytest.mark.parametrize("function", ["cross_entropy", "token_loss"])
def test_skipping_ignored_tokens_forms_only_the_trained_rows(
    function: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``skip_ignored`` (the default) sends only the labelled tokens through the matmuls, in
    ragged chunks, with the same loss, log-probs and gradients as forming every token, and
    ``trained_count`` finds them without the synchronising ``torch.nonzero``."""
    from vocab_parallel import _fused_linear

    hidden, weight, labels = linear_case(torch.float32, 12)
    valid = labels != IGNORE
    k = int(valid.sum())
    assert 0 < k < labels.numel()  # the test can fail: some tokens are ignored, some not
    coef = upstream(LINEAR_SHAPE, seed=12).float()
    rows: list[int] = []
    chunk_logits = _fused_linear._chunk_logits

    def count_rows(h_chunk: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows.append(h_chunk.shape[0])
        return chunk_logits(h_chunk, w)

    monkeypatch.setattr(_fused_linear, "_chunk_logits", count_rows)

    def run(**options: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        if function == "cross_entropy":
            loss = vp.linear_cross_entropy(h, w, labels, chunk_size=7, **options)  # type: ignore[arg-type]
            log_p = torch.zeros(())
        else:
            loss, log_p = vp.fused_linear_token_loss(
                h,
                w,
                labels,
                coef,
                chunk_size=7,
                return_log_probs=True,
                **options,  # type: ignore[arg-type]
            )
        loss.backward()
        assert h.grad is not None and w.grad is not None
        return loss.detach(), log_p, h.grad, w.grad

    every = run(skip_ignored=False)
    assert sum(rows) == labels.numel() and max(rows) == 7
    rows.clear()
    skipped = run()
    assert sum(rows) == k and rows[-1] == (k % 7 or 7), rows  # ragged chunks of trained rows
    rows.clear()
    monkeypatch.setattr(torch, "nonzero", lambda *a, **kw: pytest.fail("torch.nonzero ran"))
    counted = run(trained_count=k, validate=True)
    assert sum(rows) == k
    for got in (skipped, counted):
        for a, b in zip(got, every, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not skipped[2][~valid].any()  # the ignored rows' hidden gradient is exactly 0
    if function == "token_loss":
        assert not skipped[1][~valid].any()
        ref_loss, ref_h, ref_w = _reference(hidden, weight, labels, coef.double(), 1.0)
        assert abs(float(skipped[0]) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        assert (
            relative_error(skipped[2], ref_h) <= 2e-6 and relative_error(skipped[3], ref_w) <= 2e-6
        )


def test_trained_count_is_checked() -> None:
    hidden, weight, labels = linear_case(torch.float32, 13)
    k = int((labels != IGNORE).sum())
    with pytest.raises(ValueError, match=r"outside \[0, 33\]"):
        vp.linear_cross_entropy(hidden, weight, labels, trained_count=34)
    with pytest.raises(ValueError, match=f"trained_count={k - 1}, but {k} labels"):
        vp.linear_cross_entropy(hidden, weight, labels, trained_count=k - 1, validate=True)
    # Not skipping: the count is not needed, and nothing reads it.
    loss = vp.linear_cross_entropy(hidden, weight, labels, skip_ignored=False, trained_count=34)
    assert torch.isfinite(loss)
