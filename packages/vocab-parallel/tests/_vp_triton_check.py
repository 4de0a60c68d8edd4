"""Check the Triton backend against the float64 reference; run as a script.

On CPU it needs TRITON_INTERPRET=1 in the environment (set by the calling test) so that the
kernels run in Triton's interpreter; on CUDA (``--device cuda``) they run compiled.
"""

from __future__ import annotations

import argparse

import pytest
import torch

import _vp_reference as reference
import vocab_parallel as vp
from _vp_reference import IGNORE
from train_testing.reference import relative_error, token_log_probs


def check(device: str, vocab: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    masked = max(1, vocab // 10)
    logits = reference.make_logits(shape, vocab, seed=vocab, masked_columns=masked).to(dtype)
    labels = reference.make_labels(shape, vocab, seed=vocab, low=masked).to(device)
    # Tolerances: values accumulate in fp32 either way; bf16 gradients are rounded to bf16
    # (and the CPU interpreter may truncate instead of round).
    v_atol = 5e-5
    g_atol, g_rtol = (3e-6, 1e-5) if dtype == torch.float32 else (8e-3, 2e-2)
    w1, w2 = (
        reference.upstream(shape, seed=1).to(device),
        reference.upstream(shape, seed=2).to(device),
    )
    for temperature in (1.0, 0.7):
        x = logits.to(device).detach().clone().requires_grad_()
        ref = logits.to(device).detach().double().requires_grad_()
        log_p, ent = vp.token_log_probs_and_entropy(
            x, labels, temperature=temperature, backend="triton"
        )
        ref_lp = token_log_probs(ref, labels, temperature=temperature)
        ref_h = reference.ref_entropy(ref, temperature)
        what = f"{device} V={vocab} {dtype} T={temperature}"
        torch.testing.assert_close(
            log_p.double(), ref_lp, atol=v_atol, rtol=1e-5, msg=lambda m, what=what: f"{what}: {m}"
        )
        torch.testing.assert_close(
            ent.double(), ref_h, atol=v_atol, rtol=1e-5, msg=lambda m, what=what: f"{what}: {m}"
        )
        (log_p.double() * w1 + ent.double() * w2).sum().backward()
        (ref_lp * w1 + ref_h * w2).sum().backward()
        assert x.grad is not None and x.grad.dtype == dtype
        torch.testing.assert_close(
            x.grad.double(),
            ref.grad,
            atol=g_atol,
            rtol=g_rtol,
            msg=lambda m, what=what: f"grad {what}: {m}",
        )
        assert torch.all(x.grad[labels == IGNORE][..., :masked] == 0)

    # Cross-entropy with label smoothing (no masked columns: smoothing over -inf is infinite).
    plain = reference.make_logits(shape, vocab, seed=vocab + 1).to(dtype)
    x = plain.to(device).detach().clone().requires_grad_()
    ref = plain.to(device).detach().double().requires_grad_()
    ce = vp.cross_entropy(x, labels, label_smoothing=0.1, backend="triton")
    ref_ce = reference.ref_cross_entropy(ref, labels, IGNORE, "mean", 0.1)
    torch.testing.assert_close(ce.double(), ref_ce, atol=v_atol, rtol=1e-5)
    ce.backward()
    ref_ce.backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=g_atol, rtol=g_rtol)

    # A strided slice (the usual logits[:, :-1] shift) is read in place by the kernels.
    if len(shape) == 2 and shape[1] > 1:
        x = logits.to(device).detach().clone().requires_grad_()
        y = logits.to(device).detach().clone().requires_grad_()
        sliced = labels[:, :-1]
        a = vp.token_log_probs_and_entropy(x[:, :-1], sliced, backend="triton")
        b = vp.token_log_probs_and_entropy(y[:, :-1], sliced, backend="torch")
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6)
        (a[0] * 2 + a[1]).sum().backward()
        (b[0] * 2 + b[1]).sum().backward()
        assert x.grad is not None and y.grad is not None
        torch.testing.assert_close(x.grad, y.grad, atol=g_atol, rtol=g_rtol)

    # Same numbers as the PyTorch backend.
    x = logits.to(device)
    torch.testing.assert_close(
        vp.token_log_probs(x, labels, backend="triton"),
        vp.token_log_probs(x, labels, backend="torch"),
        atol=1e-5,
        rtol=1e-6,
    )


def check_linear(device: str, vocab: int, tokens: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(tokens, 16, generator=gen).to(dtype)
    weight = (torch.randn(vocab, 16, generator=gen) * 0.5).to(dtype)
    labels = reference.make_labels((tokens,), vocab, seed=vocab).to(device)
    h = hidden.to(device).requires_grad_()
    w = weight.to(device).requires_grad_()
    out = vp.linear_token_log_probs(h, w, labels, temperature=1.2, chunk_size=7, backend="triton")
    # The reference for the fused form: the torch backend on the same inputs (itself checked
    # against float64 by the CPU suite), so both see the same low-precision matmul outputs.
    h2 = hidden.to(device).requires_grad_()
    w2 = weight.to(device).requires_grad_()
    ref = vp.linear_token_log_probs(h2, w2, labels, temperature=1.2, chunk_size=7, backend="torch")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    weights = reference.upstream((tokens,), seed=3).float().to(device)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    assert h.grad is not None and w.grad is not None
    g_tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(h.grad, h2.grad, **g_tol)
    torch.testing.assert_close(w.grad, w2.grad, **g_tol)


def check_linear_float64(
    device: str, *, tokens: int, vocab: int, hidden_dim: int, dtype: torch.dtype, chunk: int | None
) -> None:
    """The Triton form against float64 log_softmax of h @ w.T, fwd and bwd, many blocks."""
    gen = torch.Generator().manual_seed(tokens + vocab)
    hidden = torch.randn(tokens, hidden_dim, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_dim, generator=gen) * 2 / hidden_dim**0.5).to(dtype)
    labels = reference.make_labels((tokens,), vocab, seed=vocab).to(device)
    weights = reference.upstream((tokens,), seed=5).double().to(device)
    for temperature in (1.0, 0.8):
        h = hidden.to(device).clone().requires_grad_()
        w = weight.to(device).clone().requires_grad_()
        out = vp.linear_token_log_probs(
            h,
            w,
            labels,
            temperature=temperature,
            chunk_size=chunk,
            backend="triton",
        )
        rh = hidden.to(device).double().requires_grad_()
        rw = weight.to(device).double().requires_grad_()
        ref = token_log_probs(rh @ rw.T, labels, temperature=temperature)
        what = f"{device} N={tokens} V={vocab} H={hidden_dim} {dtype} chunk={chunk} T={temperature}"
        # Values: the block logits are rounded to the input dtype by the matmul (as in any
        # 16-bit matmul); |z| stays below about 12 here, so a logit is off by at most
        # 12 * 2^-9 in bf16 (12 * 2^-12 in fp16).
        atol = 4e-2 if dtype == torch.bfloat16 else 5e-3
        torch.testing.assert_close(
            out.double(), ref, atol=atol, rtol=0, msg=lambda m, what=what: f"{what}: {m}"
        )
        (out.double() * weights).sum().backward()
        (ref * weights).sum().backward()
        assert h.grad is not None and w.grad is not None and rh.grad is not None
        assert rw.grad is not None and h.grad.dtype == dtype and w.grad.dtype == dtype
        # Gradients: the logits (and their gradient) are rounded to the input dtype around
        # each matmul, as in autograd's own matmul backward.
        for name, got, want in (("hidden", h.grad, rh.grad), ("weight", w.grad, rw.grad)):
            scale = want.abs().max().item()
            torch.testing.assert_close(
                got.double(),
                want,
                atol=1.5e-2 * scale,
                rtol=2e-2,
                msg=lambda m, what=what, name=name: f"{name} grad {what}: {m}",
            )
        assert torch.all(w.grad.float().abs().sum(1) > 0)  # every row got its softmax share


def check_in_place(device: str, dtype: torch.dtype) -> None:
    """in_place=True: the same gradient as out-of-place, written into the logits' storage."""
    shape, vocab = (3, 7), 300
    logits = reference.make_logits(shape, vocab, seed=31).to(dtype).to(device)
    labels = reference.make_labels(shape, vocab, seed=31).to(device)
    weights = reference.upstream(shape, seed=31).float().to(device)
    for sliced in (False, True):
        x = logits.clone().requires_grad_()
        y = logits.clone().requires_grad_()
        for t, in_place in ((x, True), (y, False)):
            view = t[:, :-1] if sliced else t
            target = labels[:, :-1] if sliced else labels
            log_p, ent = vp.token_log_probs_and_entropy(
                view, target, temperature=0.9, backend="triton", in_place=in_place
            )
            (log_p * weights[:, : view.shape[1]] + ent).sum().backward()
        assert x.grad is not None and y.grad is not None
        torch.testing.assert_close(x.grad, y.grad, atol=0, rtol=0)
        if not sliced:
            assert x.grad.data_ptr() == x.data_ptr()


def check_scale_strides(device: str) -> None:
    """The grid-stride scaling kernel: every element scaled once when programs stride over
    several blocks (to one rounding of the dtype: the interpreter may truncate), and a scale of
    1 changes nothing."""
    from vocab_parallel import _triton_scale

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3 * 4096 + 77, generator=gen).to(dtype).to(device)
        for value, programs in ((0.37, 2), (0.37, None), (1.0, 2)):
            got = x.clone()
            scale = torch.tensor([value], device=device, dtype=torch.float32)
            _triton_scale.scale_(got, scale, max_programs=programs)
            if value == 1.0:
                assert torch.equal(got, x), (dtype, programs)
                continue
            want = x.double() * value
            ulp = {torch.float32: 1e-6, torch.bfloat16: 2**-7}[dtype]
            assert ((got.double() - want).abs() <= ulp * want.abs()).all(), (dtype, programs)


def check_cross_entropy_in_forward(device: str, dtype: torch.dtype, vocab: int) -> None:
    """cross_entropy(in_place=True) forms the gradient in forward (one kernel per row) and
    backward only scales it: loss and gradient against float64 F.cross_entropy, for "sum" and
    "mean", contiguous and sliced logits, upstream gradients 1 and 0.37."""
    shape = (3, 7)
    logits = reference.make_logits(shape, vocab, seed=41).to(dtype).to(device)
    labels = reference.make_labels(shape, vocab, seed=41).to(device)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 2e-2}
    for reduction in ("sum", "mean"):
        for sliced in (False, True):
            for upstream in (1.0, 0.37):
                x = logits.clone().requires_grad_()
                view = x[:, :-1] if sliced else x
                target = labels[:, :-1] if sliced else labels
                loss = vp.cross_entropy(
                    view, target, reduction=reduction, backend="triton", in_place=True
                )
                ref_x = logits.double().requires_grad_()
                ref_view = ref_x[:, :-1] if sliced else ref_x
                ref = torch.nn.functional.cross_entropy(
                    ref_view.reshape(-1, vocab),
                    target.reshape(-1),
                    ignore_index=IGNORE,
                    reduction=reduction,
                )
                what = f"{device} {dtype} V={vocab} {reduction} {sliced=} {upstream=}"
                # Formed in forward: the logits already hold the (unscaled) gradient.
                assert not torch.equal(x.detach(), logits), what
                assert abs(loss.item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item())), what
                (loss * upstream).backward()
                (ref * upstream).backward()
                assert x.grad is not None and ref_x.grad is not None
                torch.testing.assert_close(
                    x.grad.double(), ref_x.grad, **tol, msg=lambda m, w=what: f"{w}: {m}"
                )
                if not sliced:
                    assert x.grad.data_ptr() == x.data_ptr(), what  # no logits-sized buffer
                with pytest.raises(RuntimeError, match=r"second time|backward ran twice"):
                    loss.backward()
    # A mean over no trained token is nan, as in PyTorch; the gradient is zero.
    x = logits.clone().requires_grad_()
    loss = vp.cross_entropy(
        x, torch.full_like(labels, IGNORE), reduction="mean", backend="triton", in_place=True
    )
    assert torch.isnan(loss)
    loss.backward()
    assert x.grad is not None and not x.grad.any()


def check_fused_float64(
    device: str, *, tokens: int, vocab: int, hidden_dim: int, dtype: torch.dtype, chunk: int | None
) -> None:
    """The grads-in-forward loss (Triton) against float64 log_softmax of h @ w.T."""
    gen = torch.Generator().manual_seed(tokens + vocab + 1)
    hidden = torch.randn(tokens, hidden_dim, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_dim, generator=gen) * 2 / hidden_dim**0.5).to(dtype)
    labels = reference.make_labels((tokens,), vocab, seed=vocab).to(device)
    coef = reference.upstream((tokens,), seed=6).to(device)
    rh = hidden.to(device).double().requires_grad_()
    rw = weight.to(device).double().requires_grad_()
    ref = (token_log_probs(rh @ rw.T, labels, temperature=0.8) * coef).sum()
    ref_h, ref_w = torch.autograd.grad(ref, [rh, rw])
    # (fp32 logits, fp32 weight-gradient sum, relative error allowed): with both, only the
    # final bf16/fp16 rounding remains.
    for fp32_logits, fp32_weight_grad, tol in (
        (True, True, 4e-3),
        (False, True, 6e-3),
        (False, False, 1.5e-2),
    ):
        h = hidden.to(device).clone().requires_grad_()
        w = weight.to(device).clone().requires_grad_()
        loss = vp.fused_linear_token_loss(
            h,
            w,
            labels,
            coef.float(),
            temperature=0.8,
            chunk_size=chunk,
            backend="triton",
            fp32_logits=fp32_logits,
            fp32_weight_grad=fp32_weight_grad,
        )
        assert abs(loss.item() - ref.item()) <= 5e-3 * max(1.0, abs(ref.item())), (loss, ref)
        loss.backward()
        assert h.grad is not None and w.grad is not None
        for name, got, want in (("hidden", h.grad, ref_h), ("weight", w.grad, ref_w)):
            err = relative_error(got, want)
            assert err <= tol, (
                f"fused {name} grad {device} {dtype} {fp32_logits=} {fp32_weight_grad=}: {err}"
            )


def check_fused_upstream_scale(device: str, dtype: torch.dtype) -> None:
    """Backward scales the gradients formed in forward by the upstream gradient (a Triton kernel
    on this backend): grads of ``loss * s`` equal ``s`` times the grads of ``loss``, to one
    rounding of the gradient's dtype, and the default scale of 1 changes nothing."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(40, 24, generator=gen).to(dtype).to(device)
    weight = (torch.randn(101, 24, generator=gen) / 5).to(dtype).to(device)
    labels = reference.make_labels((40,), 101, seed=12).to(device)
    scale = 0.37
    grads = []
    for factor in (1.0, scale):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = vp.linear_cross_entropy(
            h,
            w,
            labels,
            reduction="sum",
            chunk_size=16,
            backend="triton",
            fp32_weight_grad=False,
        )
        (loss * factor).backward()
        grads.append((h.grad, w.grad))
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    for base, scaled in zip(grads[0], grads[1], strict=True):
        want = base.double() * scale
        assert ((scaled.double() - want).abs() <= ulp * want.abs() + 1e-30).all(), dtype


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":  # interpreter: tiny sizes
        cases = [(37, (3, 5)), (5, (4,)), (300, (2, 3))]
    else:  # several BLOCK steps per row, uneven tail
        cases = [(37, (3, 5)), (20011, (4, 9)), (151936, (16,))]
    for vocab, shape in cases:
        for dtype in (torch.float32, torch.bfloat16):
            check(args.device, vocab, shape, dtype)
            check_linear(args.device, vocab, 6, dtype)
    if args.device == "cpu":  # interpreter: tiny sizes, several blocks
        linear = [(37, 101, 24, 40), (20, 70, 32, None)]
    else:  # many blocks with a ragged tail; a realistic vocabulary in default blocks
        linear = [(300, 20011, 200, 5000), (256, 151936, 256, None), (1000, 4096, 1024, 1024)]
    check_scale_strides(args.device)
    for dtype in (torch.float32, torch.bfloat16):
        check_in_place(args.device, dtype)
        check_fused_upstream_scale(args.device, dtype)
        for vocab in (37, 300) if args.device == "cpu" else (37, 151936):
            check_cross_entropy_in_forward(args.device, dtype, vocab)
    if args.device == "cpu":
        fused = [(37, 101, 24, 8)]
    else:
        fused = [(300, 20011, 200, 64), (4096, 151936, 256, None)]
    for check_float64, sizes in ((check_fused_float64, fused), (check_linear_float64, linear)):
        for tokens, vocab, hidden_dim, chunk in sizes:
            for dtype in (torch.bfloat16, torch.float16):
                dims = {"tokens": tokens, "vocab": vocab, "hidden_dim": hidden_dim}
                check_float64(args.device, **dims, dtype=dtype, chunk=chunk)
    print("ok")


if __name__ == "__main__":
    main()
