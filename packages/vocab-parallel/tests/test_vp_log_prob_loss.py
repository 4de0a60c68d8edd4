"""fused_linear_log_prob_loss: an elementwise function of each token's log-prob (a PPO / GRPO
clipped objective) with its gradients formed in forward, against float64 references (plain
log_softmax + gather over the dense logits, the same function applied by autograd)."""

from __future__ import annotations

import pytest
import torch

import vocab_parallel as vp
from _vp_reference import (
    IGNORE,
    LINEAR_HIDDEN,
    LINEAR_SHAPE,
    clipped_surrogate,
    clipped_with_entropy_bonus,
    linear_case,
    policy_inputs,
    ref_entropy,
)
from train_testing.reference import relative_error, token_log_probs


def _reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inputs: tuple[torch.Tensor, ...],
    temperature: float,
    *,
    entropy_bonus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, hidden grad, weight grad) in float64: the function over the trained tokens.

    With ``entropy_bonus`` the function is :func:`clipped_with_entropy_bonus` of the log-probs
    and the entropies, both from the reference's log_softmax.

    From exact logits for fp32 inputs; for 16-bit inputs from the unfused matmul's rounded
    logits (``hidden @ weight.T`` in that dtype), since their rounding moves each ratio (and
    may cross the clip) in a way no 16-bit form can undo. Both gradients follow from the
    logits' gradient by the chain rule, in float64.
    """
    exact = hidden.dtype == torch.float32
    logits = (hidden.double() @ weight.double().T) if exact else (hidden @ weight.T).double()
    logits.requires_grad_()
    log_p = token_log_probs(logits, labels, temperature=temperature)
    constants = [x.double() for x in inputs]
    if entropy_bonus:
        entropy = ref_entropy(logits, temperature)
        per_token = clipped_with_entropy_bonus(log_p, entropy, *constants)
    else:
        per_token = clipped_surrogate(log_p, *constants)
    loss = torch.where(labels != IGNORE, per_token, 0.0).sum()
    (grad_logits,) = torch.autograd.grad(loss, [logits])
    grad_h = grad_logits @ weight.double()
    grad_w = grad_logits.reshape(-1, weight.shape[0]).T @ hidden.double().reshape(-1, LINEAR_HIDDEN)
    return loss.detach(), grad_h, grad_w


def _policy_inputs(hidden, weight, labels, temperature, seed):  # type: ignore[no-untyped-def]
    with torch.no_grad():
        log_p = token_log_probs(
            hidden.double() @ weight.double().T, labels, temperature=temperature
        )
    return policy_inputs(log_p, seed=seed)


@pytest.mark.parametrize("skip_ignored", [True, False])
@pytest.mark.parametrize(("temperature", "chunk_size"), [(1.0, None), (1.3, 7)])
def test_clipped_policy_loss_matches_float64(
    skip_ignored: bool, temperature: float, chunk_size: int | None
) -> None:
    hidden, weight, labels = linear_case(torch.float32, 21)
    inputs = _policy_inputs(hidden, weight, labels, temperature, seed=21)
    ratio = torch.exp(
        token_log_probs(hidden.double() @ weight.double().T, labels, temperature=temperature)
        - inputs[0].double()
    )
    trained = labels != IGNORE
    clipped = trained & ((ratio < 0.8) | (ratio > 1.2))
    # The test can fail: some trained tokens sit in the clipped range, some do not.
    assert 0 < int(clipped.sum()) < int(trained.sum())
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, log_p = vp.fused_linear_log_prob_loss(
        h,
        w,
        labels,
        clipped_surrogate,
        inputs,
        temperature=temperature,
        chunk_size=chunk_size,
        skip_ignored=skip_ignored,
        validate=True,
        return_log_probs=True,
    )
    loss.backward()
    ref_loss, ref_h, ref_w = _reference(hidden, weight, labels, inputs, temperature)
    assert abs(float(loss.detach()) - float(ref_loss)) <= 1e-5 * max(1.0, abs(float(ref_loss)))
    assert h.grad is not None and w.grad is not None
    assert relative_error(h.grad, ref_h) <= 2e-6 and relative_error(w.grad, ref_w) <= 2e-6
    assert not h.grad[~trained].any()
    expected_log_p = token_log_probs(
        hidden.double() @ weight.double().T, labels, temperature=temperature
    )
    torch.testing.assert_close(log_p.double(), expected_log_p, atol=1e-5, rtol=1e-5)


def test_bf16_policy_loss_is_within_bf16_rounding() -> None:
    hidden, weight, labels = linear_case(torch.bfloat16, 22)
    inputs = _policy_inputs(hidden, weight, labels, 1.0, seed=22)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    vp.fused_linear_log_prob_loss(h, w, labels, clipped_surrogate, inputs).backward()
    _, ref_h, ref_w = _reference(hidden, weight, labels, inputs, 1.0)
    assert h.grad is not None and w.grad is not None
    # The gradients' rounding to bf16 (about 1.7e-3) and the chunk's bf16 logits gradient.
    assert relative_error(h.grad, ref_h) <= 6e-3 and relative_error(w.grad, ref_w) <= 6e-3


def test_a_linear_function_equals_the_fixed_coefficient_loss() -> None:
    hidden, weight, labels = linear_case(torch.float32, 23)
    coef = torch.randn(LINEAR_SHAPE, generator=torch.Generator().manual_seed(23))

    def run(by_function: bool) -> tuple[torch.Tensor, ...]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if by_function:
            loss = vp.fused_linear_log_prob_loss(
                h, w, labels, lambda lp, c: c * lp, (coef,), chunk_size=7
            )
        else:
            loss = vp.fused_linear_token_loss(h, w, labels, coef, chunk_size=7)
        assert isinstance(loss, torch.Tensor)
        (loss * 0.5).backward()  # a non-unit upstream gradient scales both alike
        assert h.grad is not None and w.grad is not None
        return loss.detach(), h.grad, w.grad

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_scalar_inputs_and_a_loss_without_log_probs() -> None:
    hidden, weight, labels = linear_case(torch.float32, 24)
    trained = int((labels != IGNORE).sum())
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    # A 0-dim input is shared by every token; a loss that ignores log p has no gradient.
    loss = vp.fused_linear_log_prob_loss(
        h, w, labels, lambda lp, c: c.expand_as(lp).clone(), (torch.tensor(0.25),)
    )
    assert isinstance(loss, torch.Tensor)
    assert float(loss.detach()) == pytest.approx(
        0.25 * trained
    )  # summed over the trained tokens only
    loss.backward()
    assert h.grad is not None and w.grad is not None
    assert not h.grad.any() and not w.grad.any()


def test_misuse_raises_with_the_fix() -> None:
    hidden, weight, labels = linear_case(torch.float32, 25)
    with pytest.raises(ValueError, match="not elementwise"):
        vp.fused_linear_log_prob_loss(
            hidden, weight, labels, lambda lp: lp - lp.mean(), validate=True, chunk_size=8
        )
    with pytest.raises(ValueError, match=r"returned \(\); expected one loss per token"):
        vp.fused_linear_log_prob_loss(hidden, weight, labels, lambda lp: lp.sum())
    with pytest.raises(ValueError, match=r"token_inputs\[0\] have shape \(4,\)"):
        vp.fused_linear_log_prob_loss(
            hidden, weight, labels, lambda lp, x: lp * x, (torch.ones(4),)
        )
    needs_grad = torch.ones(LINEAR_SHAPE, requires_grad=True)
    with pytest.raises(ValueError, match=r"pass token_inputs\[0\]\.detach\(\)"):
        vp.fused_linear_log_prob_loss(hidden, weight, labels, lambda lp, x: lp * x, (needs_grad,))
    with pytest.raises(TypeError, match="token_loss must be a function"):
        vp.fused_linear_log_prob_loss(hidden, weight, labels, 3.0)  # type: ignore[arg-type]
    # Without validate the elementwise check does not run (no extra calls of the function).
    calls: list[int] = []

    def counted(lp: torch.Tensor) -> torch.Tensor:
        calls.append(lp.shape[0])
        return -lp

    vp.fused_linear_log_prob_loss(hidden, weight, labels, counted, chunk_size=8)
    trained = int((labels != IGNORE).sum())
    assert sum(calls) == trained and max(calls) == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton chunk path runs on CUDA")
@pytest.mark.parametrize("entropy_bonus", [False, True])
def test_clipped_policy_loss_on_cuda_matches_float64(entropy_bonus: bool) -> None:
    """On the GPU (Triton statistics and in-place gradient kernels): bf16 within rounding."""
    hidden, weight, labels = linear_case(torch.bfloat16, 26)
    inputs = _policy_inputs(hidden, weight, labels, 1.0, seed=26)
    h = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    loss = vp.fused_linear_log_prob_loss(
        h,
        w,
        labels.cuda(),
        clipped_with_entropy_bonus if entropy_bonus else clipped_surrogate,
        [x.cuda() for x in inputs],
        chunk_size=7,
        with_entropy=entropy_bonus,
    )
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    ref_loss, ref_h, ref_w = _reference(
        hidden, weight, labels, inputs, 1.0, entropy_bonus=entropy_bonus
    )
    assert abs(float(loss.detach()) - float(ref_loss)) <= 1e-3 * max(1.0, abs(float(ref_loss)))
    assert h.grad is not None and w.grad is not None
    assert (
        relative_error(h.grad.cpu(), ref_h) <= 6e-3 and relative_error(w.grad.cpu(), ref_w) <= 6e-3
    )


def test_no_grad_and_frozen_weight_give_the_same_loss() -> None:
    """Without gradients the function still gives the loss; a frozen weight only the hidden's."""
    hidden, weight, labels = linear_case(torch.float32, 27)
    inputs = _policy_inputs(hidden, weight, labels, 1.0, seed=27)
    ref_loss, ref_h, _ = _reference(hidden, weight, labels, inputs, 1.0)
    with torch.no_grad():
        loss = vp.fused_linear_log_prob_loss(hidden, weight, labels, clipped_surrogate, inputs)
    assert isinstance(loss, torch.Tensor) and not loss.requires_grad
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * max(1.0, abs(float(ref_loss)))
    h = hidden.clone().requires_grad_()
    frozen = vp.fused_linear_log_prob_loss(h, weight, labels, clipped_surrogate, inputs)
    assert isinstance(frozen, torch.Tensor)
    frozen.backward()
    assert h.grad is not None and relative_error(h.grad, ref_h) <= 2e-6


@pytest.mark.parametrize(("skip_ignored", "temperature"), [(True, 1.3), (False, 1.0)])
def test_entropy_bonus_matches_float64(skip_ignored: bool, temperature: float) -> None:
    """``with_entropy``: the function reads each token's entropy, whose gradient flows through
    the logits too; the returned entropies equal the reference's (0 where ignored)."""
    hidden, weight, labels = linear_case(torch.float32, 28)
    inputs = _policy_inputs(hidden, weight, labels, temperature, seed=28)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, log_p, entropy = vp.fused_linear_log_prob_loss(
        h,
        w,
        labels,
        clipped_with_entropy_bonus,
        inputs,
        temperature=temperature,
        chunk_size=7,
        skip_ignored=skip_ignored,
        return_log_probs=True,
        with_entropy=True,
        validate=True,
    )
    loss.backward()
    ref_loss, ref_h, ref_w = _reference(
        hidden, weight, labels, inputs, temperature, entropy_bonus=True
    )
    assert abs(float(loss.detach()) - float(ref_loss)) <= 1e-5 * max(1.0, abs(float(ref_loss)))
    assert h.grad is not None and w.grad is not None
    assert relative_error(h.grad, ref_h) <= 2e-6 and relative_error(w.grad, ref_w) <= 2e-6
    trained = labels != IGNORE
    expected = ref_entropy(hidden.double() @ weight.double().T, temperature)
    torch.testing.assert_close(
        entropy.double(), torch.where(trained, expected, 0.0), atol=1e-5, rtol=1e-5
    )
    # The bonus changes the gradients (the test can fail): without it they differ.
    _, plain_h, _ = _reference(hidden, weight, labels, inputs, temperature)
    assert relative_error(plain_h, ref_h) > 1e-3
    assert log_p.shape == entropy.shape == LINEAR_SHAPE


def test_entropy_for_logging_leaves_the_loss_unchanged() -> None:
    hidden, weight, labels = linear_case(torch.float32, 29)
    inputs = _policy_inputs(hidden, weight, labels, 1.0, seed=29)

    def run(with_entropy: bool) -> tuple[torch.Tensor, ...]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if with_entropy:
            loss, _, entropy = vp.fused_linear_log_prob_loss(
                h,
                w,
                labels,
                lambda lp, _entropy, *rest: clipped_surrogate(lp, *rest),
                inputs,
                return_log_probs=True,
                with_entropy=True,
            )
            assert bool((entropy[labels != IGNORE] > 0).all())
        else:
            loss = vp.fused_linear_log_prob_loss(h, w, labels, clipped_surrogate, inputs)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        assert h.grad is not None and w.grad is not None
        return loss.detach(), h.grad, w.grad

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
