"""CUDA-only paths: HybridEP (needs deep_ep), NCCL all-to-all, and torch._grouped_mm experts.

On a CPU machine these skip with the reason; the HybridEP import error is checked here too.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _moe_dispatch_ref import Case, assert_close, make_weights, reference_grads
from _moe_dispatch_workers import check_hybrid_ep, check_moe_cases
from moe_dispatch import GroupedExperts, HybridEPDispatcher
from train_testing import RankPool, requires_cuda, requires_module

_HAVE_DEEP_EP = importlib.util.find_spec("deep_ep") is not None


@pytest.mark.skipif(
    _HAVE_DEEP_EP, reason="deep_ep is installed; the missing-module error cannot occur"
)
def test_hybrid_ep_without_deep_ep_names_the_extra_and_build_steps() -> None:
    with pytest.raises(ImportError) as info:
        HybridEPDispatcher(None, num_experts=8)
    message = str(info.value)
    assert "'hybridep' extra" in message
    assert "hybrid-ep" in message and "not on PyPI" in message


@pytest.mark.timeout(300)
@requires_cuda(2)
def test_nccl_all_to_all_matches_reference() -> None:
    case = Case((0, 21), seed=31, hidden_size=16, intermediate_size=24, num_experts=4, top_k=2)
    with RankPool(2, backend="nccl") as pool:
        per_rank = pool.run(check_moe_cases, [case], "cuda", timeout_s=240)
    ref = reference_grads(case, make_weights(case))
    # TF32 may be on for CUDA matmuls: a looser bound than the gloo fp32 test.
    for variant in ("plain", "padded"):
        got = [per_rank[r][0][variant] for r in range(2)]
        for key in ("out", "x", "gate_up", "down"):
            assert_close(
                f"nccl {variant} {key}",
                torch.cat([g[key] for g in got]),
                ref[key],
                atol=2e-3,
                rtol=2e-3,
            )


@pytest.mark.timeout(300)
@requires_cuda(2)
@requires_module("deep_ep", extra="hybridep")
def test_hybrid_ep_matches_all_to_all_with_uneven_counts() -> None:
    # Unequal counts, one rank empty: HybridEP needs the equalization to run at all.
    case = Case((0, 37), seed=41, hidden_size=64, intermediate_size=32, num_experts=8, top_k=2)
    with RankPool(2, backend="nccl") as pool:
        per_rank = pool.run(check_hybrid_ep, case, timeout_s=240)
    for r in range(2):
        a2a, hybrid = per_rank[r]["a2a"], per_rank[r]["hybrid"]
        assert torch.equal(a2a["ids"], hybrid["ids"])
        for key in ("out", "x", "router", "gate_up", "down"):
            assert_close(f"rank {r} {key}", hybrid[key], a2a[key], atol=3e-2, rtol=3e-2)


@requires_cuda(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mm_matches_expert_loop(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    loop = GroupedExperts(4, 64, 32, grouped_mm="never", device="cuda", dtype=dtype)
    grouped = GroupedExperts(4, 64, 32, grouped_mm="always", device="cuda", dtype=dtype)
    grouped.load_state_dict(loop.state_dict())
    counts = torch.tensor([5, 0, 17, 3], device="cuda")
    x = torch.randn(25, 64, device="cuda", dtype=dtype)
    results = []
    for module in (loop, grouped):
        xi = x.clone().requires_grad_()
        out = module(xi, counts)
        out.float().pow(2).sum().backward()
        results.append([out, xi.grad, module.gate_up_proj.grad, module.down_proj.grad])
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    for name, a, b in zip(("out", "x", "gate_up", "down"), *results, strict=True):
        assert a is not None and b is not None
        assert_close(f"grouped_mm {dtype} {name}", b, a, atol=tol, rtol=tol)
