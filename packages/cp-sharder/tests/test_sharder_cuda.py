"""CUDA-only checks (skipped on CPU machines with the reason; run them on the GPU machine)."""

from __future__ import annotations

import pytest

import _cps_workers as workers
import _packed_workers
from train_testing import requires_cuda, requires_module, run_on_ranks

LOSS_TOL = 1e-4  # TF32 is off by default for matmuls in fp32; kernels differ from CPU
GRAD_TOL = 1e-3


@requires_cuda(2)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["llama", "qwen3_sliding"])
def test_portable_and_torch_ring_on_nccl(arch: str) -> None:
    results = run_on_ranks(2, workers.cuda_parity, arch, backend="nccl", timeout_s=500)
    for r in results:
        for case, v in r.items():
            assert v["loss_rel_err"] < LOSS_TOL, (case, v)
            assert v["grad_rel_err"] < GRAD_TOL, (case, v)
        assert r["bshd_portable"]["backend"] == "portable"
        # Packed batches run varlen attention since issue 15 (the case keeps its old name).
        assert r["thd_portable"]["backend"] == "varlen"
        # A sliding-window model must never reach the causal-only ring.
        want = "portable" if arch == "qwen3_sliding" else "torch_ring"
        assert r["bshd_ring"]["backend"] == want


@requires_cuda(1)
@requires_module("transformer_engine", extra="te")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_thd_partition_matches_transformer_engine(world: int) -> None:
    unit = 2 * world
    cu = [0, 3 * unit, 3 * unit, 5 * unit, 9 * unit]
    assert workers.te_partition_parity(cu, world)


@requires_cuda(2)
@pytest.mark.timeout(600)
def test_packed_bf16_through_torch_varlen_on_nccl() -> None:
    """bf16 packed rows (torch's varlen_attn) at cp=2 against the CPU float64 documents alone;
    the loose bound catches masking errors (which move the loss by O(1)), not bf16 noise."""
    results = run_on_ranks(2, _packed_workers.cuda_packed_parity, backend="nccl", timeout_s=500)
    for r in results:
        for case, v in r.items():
            assert v["backend"] == "varlen", (case, v)
            assert v["loss_rel_err"] < 2e-2, (case, v)
            assert v["grad_rel_err"] < 2e-1, (case, v)
