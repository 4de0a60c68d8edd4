"""The Triton backend: interpreted on CPU in CI, compiled on the GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vocab_parallel as vp
from train_testing import requires_cuda, requires_module
from train_testing.reference import relative_error, token_log_probs, token_sum_cross_entropy

CHECK = Path(__file__).parent / "_vp_triton_check.py"
AOT = Path(__file__).parent / "_vp_triton_aot.py"


def _run_check(device: str, *, interpret: bool) -> None:
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [sys.executable, str(CHECK), "--device", device],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def _interpreter_bounds_loops_by_arguments() -> bool:
    """Triton before 3.7 hands scalar kernel arguments to its interpreter as 1-element arrays,
    which cannot bound a ``range`` loop (TypeError); 3.7 and later pass them as scalars."""
    import triton

    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 7)


@pytest.mark.slow
@requires_module("triton", extra="triton")
@pytest.mark.timeout(300)
def test_triton_kernels_match_reference_in_interpreter() -> None:
    if not _interpreter_bounds_loops_by_arguments():
        pytest.skip(
            "Triton < 3.7's interpreter cannot run these kernels (scalar arguments arrive as "
            "arrays); the compiled kernels are checked by the CUDA test instead"
        )
    _run_check("cpu", interpret=True)


@pytest.mark.slow
@requires_module("triton", extra="triton")
@pytest.mark.timeout(300)
def test_triton_kernels_compile_for_sm90_without_a_gpu(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))  # really compile, no cache hit
    result = subprocess.run(
        [sys.executable, str(AOT)], env=env, capture_output=True, text=True, timeout=280
    )
    if result.returncode != 0 and "ptxas" in result.stderr and "not found" in result.stderr:
        pytest.skip("triton's bundled ptxas is missing on this machine")
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


@requires_cuda(1)
@requires_module("triton", extra="triton")
@pytest.mark.timeout(600)
def test_triton_kernels_match_reference_on_cuda() -> None:
    _run_check("cuda", interpret=False)


@requires_cuda(1)
def test_auto_backend_on_cuda_matches_torch_backend_and_linear_form() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 256, generator=gen).bfloat16().cuda()
    weight = (torch.randn(50257, 256, generator=gen) / 16).bfloat16().cuda()
    labels = torch.randint(0, 50257, (64,), generator=gen).cuda()
    logits = hidden @ weight.T
    auto = vp.token_log_probs(logits, labels)
    torch_path = vp.token_log_probs(logits, labels, backend="torch")
    fused = vp.linear_token_log_probs(hidden, weight, labels)
    torch.testing.assert_close(auto, torch_path, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(fused, torch_path, atol=1e-4, rtol=1e-5)


def test_backend_errors() -> None:
    logits, labels = torch.randn(2, 5), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="backend must be"):
        vp.token_log_probs(logits, labels, backend="cuda")  # type: ignore[arg-type]
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises((ValueError, ImportError), match="backend='triton'"):
            vp.token_log_probs(logits, labels, backend="triton")


def test_linear_block_size_defaults() -> None:
    from vocab_parallel._linear import block_size_for

    # fp32 blocks: about 16M logits.
    assert block_size_for(8192, 151936) == (1 << 24) // 8192
    # 16-bit Triton blocks: an eighth of the vocabulary (rounded up to 128 rows) once N is
    # large, so 8 blocks whatever N is ...
    for tokens in (8192, 16384, 1 << 22):
        rows = block_size_for(tokens, 151936, low_precision=True)
        assert rows == 19072 and rows % 128 == 0 and -(-151936 // rows) == 8
    # ... and at least 64M logits when N is small (fewer blocks), capped by the vocabulary.
    assert block_size_for(1024, 151936, low_precision=True) == 65536
    assert block_size_for(3000, 151936, low_precision=True) % 128 == 0
    assert block_size_for(16, 1000, low_precision=True) == 1000
    assert block_size_for(8192, 70, low_precision=True) == 70


@requires_cuda(1)
@requires_module("triton", extra="triton")
def test_linear_default_blocks_on_cuda_match_float64() -> None:
    """The default (large, bf16) blocks over several blocks: values and both gradients against
    a float64 dense reference computed with plain PyTorch."""
    gen = torch.Generator().manual_seed(1)
    tokens, vocab, width = 16384, 10000, 32  # 4096-row blocks: 3 blocks, a ragged last one
    hidden = torch.randn(tokens, width, generator=gen).bfloat16()
    weight = (torch.randn(vocab, width, generator=gen) / 4).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::7] = -100
    upstream = torch.randn(tokens, generator=gen)
    h = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    out = vp.linear_token_log_probs(h, w, labels.cuda())
    (out * upstream.cuda()).sum().backward()
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    ref = token_log_probs(h64 @ w64.T, labels)
    (ref * upstream.double()).sum().backward()
    torch.testing.assert_close(out.double().cpu(), ref.detach(), atol=2e-2, rtol=1e-2)
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        err = relative_error(got, want)
        assert err < 1e-2, float(err)


def _float64_token_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:
    """Plain PyTorch in float64: the token-sum cross-entropy / 1000 of hidden [N, H] @ weight
    [V, H].T and its (hidden, weight) gradients (CPU), as the CUDA cases backpropagate it."""
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    ref = token_sum_cross_entropy(h64 @ w64.T, labels)
    grads = torch.autograd.grad(ref / 1000, [h64, w64])
    return ref.item(), (grads[0], grads[1])


@requires_cuda(1)
@requires_module("triton", extra="triton")
@pytest.mark.parametrize(
    ("fp32_logits", "fp32_weight_grad", "tol"),
    [(False, True, 6e-3), (True, True, 4e-3), (False, False, 1.5e-2)],
)
def test_grads_in_forward_default_chunks_on_cuda_match_float64(
    fp32_logits: bool, fp32_weight_grad: bool, tol: float
) -> None:
    """linear_cross_entropy over its default chunks (22 here, a ragged last one) on CUDA:
    loss and both gradients against a float64 dense reference computed with plain PyTorch."""
    gen = torch.Generator().manual_seed(2)
    tokens, vocab, width = 16384, 10000, 32
    hidden = torch.randn(tokens, width, generator=gen).bfloat16()
    weight = (torch.randn(vocab, width, generator=gen) / 4).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::7] = -100
    h = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    loss = vp.linear_cross_entropy(
        h,
        w,
        labels.cuda(),
        reduction="sum",
        fp32_logits=fp32_logits,
        fp32_weight_grad=fp32_weight_grad,
    )
    (loss / 1000).backward()
    ref, ref_grads = _float64_token_sum(hidden, weight, labels)
    assert abs(loss.item() - ref) <= 1e-3 * abs(ref)
    for got, want in zip((h.grad, w.grad), ref_grads, strict=True):
        assert got is not None
        err = relative_error(got, want)
        assert err < tol, float(err)


@requires_cuda(1)
@requires_module("triton", extra="triton")
@pytest.mark.parametrize("fp32_logits", [False, True])
def test_autocast_fp32_gradients_on_cuda_beat_the_bf16_floor(fp32_logits: bool) -> None:
    """fp32 master tensors under bf16 autocast on CUDA, default chunks (the Triton chunk kernel,
    fp32 hidden-gradient rows from mixed-precision matmuls, the fp32 weight accumulator handed
    back as the gradient): both gradients within 1e-3 of float64 from the same bf16 operands,
    and below the error of rounding that float64 gradient to bf16 (where any bf16 gradient is)."""
    gen = torch.Generator().manual_seed(3)
    tokens, vocab, width = 8192, 10000, 64
    # bf16-representable fp32 values: the reference sees exactly the matmuls' operands.
    hidden = torch.randn(tokens, width, generator=gen).bfloat16().float()
    weight = (torch.randn(vocab, width, generator=gen) / 16).bfloat16().float()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::7] = -100
    h = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = vp.linear_cross_entropy(
            h, w, labels.cuda(), reduction="sum", fp32_logits=fp32_logits
        )
    (loss / 1000).backward()
    ref, ref_grads = _float64_token_sum(hidden, weight, labels)
    assert abs(loss.item() - ref) <= 1e-3 * abs(ref)
    for got, want in zip((h.grad, w.grad), ref_grads, strict=True):
        assert got is not None and got.dtype == torch.float32
        err = relative_error(got, want)
        floor = relative_error(want.bfloat16(), want)
        assert err < min(1e-3, 0.7 * floor), (err, floor)
