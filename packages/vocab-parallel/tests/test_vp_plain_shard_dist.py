"""Plain local vocabulary shards + their process group (Megatron's vocab-parallel layout) on real
gloo ranks, against the single-process float64 reference and the DTensor path."""

from __future__ import annotations

import pytest

from _vp_plain_workers import check_plain_errors, check_plain_fused_linear, check_plain_logits


@pytest.mark.timeout(180)
def test_plain_shard_logits_match_reference_and_dtensor(rank_pool) -> None:
    cases = [{"vocab": 64, "uneven": False}, {"vocab": 37, "uneven": True, "seed": 3}]
    results = rank_pool.run(2, check_plain_logits, cases, timeout_s=150)
    assert all(len(r) == len(cases) for r in results), results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("uneven", [False, True])
def test_plain_shard_fused_linear_matches_reference(rank_pool, uneven: bool) -> None:
    results = rank_pool.run(2, check_plain_fused_linear, uneven, timeout_s=150)
    assert len(results) == 2


@pytest.mark.timeout(180)
def test_plain_shard_layout_errors(rank_pool) -> None:
    assert rank_pool.run(2, check_plain_errors, timeout_s=150) == ["ok", "ok"]
