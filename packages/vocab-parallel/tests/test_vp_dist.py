"""Vocab-sharded DTensors on 2 and 4 real gloo processes vs the single-process float64 reference."""

from __future__ import annotations

import pytest

from _vp_workers import (
    check_colwise_lm_head,
    check_fused_linear_sharded,
    check_logits_parity,
    check_placement_errors,
    record_collectives,
)
from train_testing import requires_cuda, run_on_ranks


def _cases(world_size: int) -> list[dict]:
    # V=64 splits evenly; V=37 and V=5 do not (V=5 over 4 ranks leaves rank 3 with no column).
    cases = [
        {"vocab": 64, "mesh": (world_size,), "vocab_mesh_dim": 0, "dtype": "float32", "masked": 5},
        {"vocab": 37, "mesh": (world_size,), "vocab_mesh_dim": 0, "dtype": "float32", "seed": 1},
        {"vocab": 37, "mesh": (world_size,), "vocab_mesh_dim": 0, "dtype": "bfloat16"},
        {"vocab": 5, "mesh": (world_size,), "vocab_mesh_dim": 0, "dtype": "float32", "seed": 2},
        # All-Replicate: each rank holds the whole vocabulary, no collective needed.
        {"vocab": 37, "mesh": (world_size,), "vocab_mesh_dim": None, "dtype": "float32"},
    ]
    if world_size == 4:
        # 2-D meshes: the vocabulary sharded over one dim, replicated over the other.
        cases += [
            {"vocab": 37, "mesh": (2, 2), "vocab_mesh_dim": 1, "dtype": "float32", "masked": 3},
            {"vocab": 37, "mesh": (2, 2), "vocab_mesh_dim": 0, "dtype": "bfloat16"},
        ]
    return cases


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dtensor_logits_match_reference(rank_pool, world_size: int) -> None:
    cases = _cases(world_size)
    results = rank_pool.run(world_size, check_logits_parity, cases, timeout_s=150)
    assert all(len(r) == len(cases) for r in results), results


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world_size", "vocab"), [(2, 64), (4, 37)])
def test_colwise_parallel_lm_head_gradients(rank_pool, world_size: int, vocab: int) -> None:
    for dtype in ("float32", "bfloat16"):
        results = rank_pool.run(world_size, check_colwise_lm_head, vocab, dtype, timeout_s=150)
        assert len(results) == world_size


@pytest.mark.timeout(180)
def test_no_collective_moves_vocabulary_sized_data(rank_pool) -> None:
    tokens, hidden = 6, 4
    small = rank_pool.run(2, record_collectives, 40, tokens, hidden, timeout_s=150)
    large = rank_pool.run(2, record_collectives, 4001, tokens, hidden, timeout_s=150)
    for name, calls in small[0].items():
        # Identical collectives whatever V is: nothing scales with the vocabulary.
        assert calls == large[0][name], f"{name}: V=40 issued {calls}, V=4001 {large[0][name]}"
        assert calls, f"{name} issued no collective on a vocab-sharded input"
        for op, numel in calls:
            assert op == "allreduce_", f"{name} issued {op}: only all-reduces are expected"
            linear = name in ("linear_token_log_probs", "linear_cross_entropy")
            bound = tokens * hidden if linear else 4 * tokens + 1
            assert numel <= bound, f"{name}: an {op} of {numel} elements (bound {bound})"
    # Forward: one MAX of [N] and one fused SUM; the recomputing linear form adds the [N, H]
    # hidden gradient in backward, the grads-in-forward form the same per chunk, in forward.
    expected_counts = {
        "token_log_probs": 2,
        "token_entropy": 2,
        "log_probs_and_entropy": 2,
        "cross_entropy": 2,
        "linear_token_log_probs": 3,
        "linear_cross_entropy": 3,
    }
    assert {k: len(v) for k, v in small[0].items()} == expected_counts, small[0]
    assert all(r == small[0] for r in small), "ranks issued different collectives"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("vocab", [64, 37])
def test_fused_linear_loss_on_sharded_lm_head(rank_pool, vocab: int) -> None:
    for dtype in ("float32", "bfloat16"):
        results = rank_pool.run(2, check_fused_linear_sharded, vocab, dtype, timeout_s=150)
        # float32 adds the two autocast cases (fp32 master tensors, bf16 matmuls)
        assert all(len(r) == (7 if dtype == "float32" else 5) for r in results), results


@pytest.mark.timeout(120)
def test_unsupported_placements_and_bad_labels_raise_on_every_rank(rank_pool) -> None:
    results = rank_pool.run(2, check_placement_errors, timeout_s=100)
    assert all(len(r) == 5 for r in results), results


@requires_cuda(2)
@pytest.mark.timeout(600)
def test_nccl_dtensor_logits_match_reference() -> None:
    """On GPUs: NCCL collectives and the Triton kernels (backend "auto" picks them on CUDA)."""
    big = {"vocab": 151936, "mesh": (2,), "vocab_mesh_dim": 0, "dtype": "bfloat16", "masked": 9}
    cases = [{**case, "device": "cuda"} for case in [*_cases(2), big]]
    results = run_on_ranks(2, check_logits_parity, cases, backend="nccl", timeout_s=500)
    assert all(len(r) == len(cases) for r in results), results
