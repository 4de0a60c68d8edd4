"""Expert-parallel MoE on 2 and 4 gloo ranks vs a single-process float64 reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _moe_dispatch_ref import Case, assert_close, make_weights, reference_grads
from _moe_dispatch_workers import (
    check_emulated_hybrid_ep,
    check_failures_are_agreed,
    check_hf_conversion,
    check_moe_cases,
)

# fp32 distributed result vs float64 reference.
ATOL = 2e-5

CASES = {
    2: [
        Case((0, 23), seed=11, hidden_size=16, intermediate_size=24, num_experts=4, top_k=2),
        replace(
            Case((9, 4), seed=12, hidden_size=8, intermediate_size=12, num_experts=6, top_k=3),
            norm_topk_prob=False,
        ),
    ],
    4: [
        Case((7, 0, 19, 3), seed=21, hidden_size=16, intermediate_size=24, num_experts=8, top_k=2),
        Case((1, 6, 0, 0), seed=22, hidden_size=12, intermediate_size=8, num_experts=4, top_k=1),
    ],
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_moe_matches_reference(rank_pool, world_size: int) -> None:
    cases = CASES[world_size]
    per_rank = rank_pool.run(world_size, check_moe_cases, cases, timeout_s=150)
    for i, case in enumerate(cases):
        ref = reference_grads(case, make_weights(case))
        for variant in ("plain", "padded"):
            got = [per_rank[r][i][variant] for r in range(world_size)]
            tag = f"W={world_size} case {i} {variant}"
            ids = torch.cat([g["ids"] for g in got])
            assert torch.equal(ids, ref["ids"]), f"{tag}: routing differs from the reference"
            assert_close(f"{tag} out", torch.cat([g["out"] for g in got]), ref["out"], atol=ATOL)
            assert_close(f"{tag} d/dx", torch.cat([g["x"] for g in got]), ref["x"], atol=ATOL)
            for r in range(world_size):
                assert_close(
                    f"{tag} d/drouter rank {r}", got[r]["router"], ref["router"], atol=ATOL
                )
            # Experts are owned contiguously, so concatenating ranks' grads gives the global order.
            for name in ("gate_up", "down"):
                assert_close(
                    f"{tag} d/d{name}", torch.cat([g[name] for g in got]), ref[name], atol=ATOL
                )
        # Padding changes nothing: same values bit for bit, forward and backward.
        for r in range(world_size):
            plain, padded = per_rank[r][i]["plain"], per_rank[r][i]["padded"]
            for key in ("out", "x", "router", "gate_up", "down"):
                assert torch.equal(plain[key], padded[key]), (
                    f"W={world_size} case {i} rank {r}: {key} differs with padding"
                )
        _check_equalization_stats(case, [per_rank[r][i]["stats"] for r in range(world_size)])


def _check_equalization_stats(case: Case, stats: list[dict]) -> None:
    """Uniform aligned sizes, no padding row at any expert, load counts only real tokens."""
    world_size = len(stats)
    longest = max(case.counts)
    want = max(-(-longest // 4) * 4, 4)
    total_real = sum(case.counts) * case.top_k
    assert sum(s["rows_at_experts"] for s in stats) == total_real
    for r, s in enumerate(stats):
        assert s["all_padded_sizes"] == [want] * world_size, f"rank {r}: {s['all_padded_sizes']}"
        assert s["padded_size"] % 4 == 0 and s["fixed_size"] % 8 == 0
        assert s["nan_rows_at_experts"] == 0, f"rank {r}: a padding row reached an expert"
        assert int(s["counts"].sum()) == s["rows_at_experts"]
        assert torch.equal(s["load_padded"], s["load_real"]), f"rank {r}: padding counted as load"
        assert bool((s["pad_ids"] == -1).all()) and bool((s["pad_weights"] == 0).all())


@pytest.mark.timeout(150)
def test_hf_blocks_convert_to_expert_parallel(rank_pool) -> None:
    pytest.importorskip("transformers")
    per_rank = rank_pool.run(2, check_hf_conversion, 5, timeout_s=140)
    for r, errors in enumerate(per_rank):
        for kind, err in errors.items():
            assert float(err) < 1e-5, f"rank {r} {kind}: converted EP block differs by {float(err)}"


@pytest.mark.timeout(120)
def test_one_rank_failing_makes_every_rank_raise(rank_pool) -> None:
    per_rank = rank_pool.run(4, check_failures_are_agreed, timeout_s=60)
    for r, (bad_ids, *bad_routes, total) in enumerate(per_rank):
        assert total == 4, f"rank {r}: the process group is unusable afterwards"
        if r == 1:
            assert bad_ids is not None and "expert id 4, outside [-1, 4)" in bad_ids
        else:
            assert bad_ids is not None and "ranks [1]" in bad_ids, f"rank {r}: {bad_ids}"
        assert len(bad_routes) == 2  # equalizing all-to-all, then HybridEP
        for message in bad_routes:
            if r == 0:
                assert message is not None and "row 0 is [99, 99]" in message
            else:
                assert message is not None and "ranks [0] could not dispatch" in message, (
                    f"rank {r}: {message}"
                )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_hybrid_ep_wrapper_over_emulated_buffer(rank_pool, world_size: int) -> None:
    """Equalization, dense routing map, probability gradients and slicing in HybridEPDispatcher.

    The buffer is a pure-torch emulation that enforces HybridEP's uniform, 4-aligned counts;
    the real DeepEP kernels are tested in test_dispatch_cuda.py on GPUs.
    """
    cases = CASES[world_size][:1]
    per_rank = rank_pool.run(world_size, check_emulated_hybrid_ep, cases, timeout_s=100)
    case = cases[0]
    ref = reference_grads(case, make_weights(case))
    got = [per_rank[r][0]["grads"] for r in range(world_size)]
    want_size = -(-max(case.counts) // 4) * 4
    for r in range(world_size):
        # One dispatch in forward; the backward reuses the handle (no new size check).
        assert per_rank[r][0]["sizes"] == [want_size], per_rank[r][0]["sizes"]
        assert_close(f"hybrid d/drouter rank {r}", got[r]["router"], ref["router"], atol=ATOL)
    for key in ("out", "x", "gate_up", "down"):
        assert_close(f"hybrid {key}", torch.cat([g[key] for g in got]), ref[key], atol=ATOL)
