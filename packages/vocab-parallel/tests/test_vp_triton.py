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


@requires_module("triton", extra="triton")
@pytest.mark.timeout(300)
def test_triton_kernels_match_reference_in_interpreter() -> None:
    _run_check("cpu", interpret=True)


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
