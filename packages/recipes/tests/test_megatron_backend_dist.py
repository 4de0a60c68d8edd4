"""The megatron backend on real gloo ranks: a megatron-core GPTModel (local spec) trained
through the Engine gives the loss, gradients, clipped update and per-document log-probs of the
unmodified HF Llama with the same weights, at tp=2 (sharded) and tp=1 (two DDP replicas)."""

from __future__ import annotations

import pytest

from _megatron_workers import check_engine_matches_hf, check_hf_export_round_trip

pytest.importorskip("megatron.core", reason="megatron-core is the megatron extra's dependency")


@pytest.mark.timeout(300)
def test_tp2_and_tp1_match_the_hf_reference_and_each_other(rank_pool) -> None:
    tp2 = rank_pool.run(2, check_engine_matches_hf, 2, timeout_s=240)
    tp1 = rank_pool.run(2, check_engine_matches_hf, 1, timeout_s=240)
    for a, b in zip(tp2, tp1, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)
        assert abs(a["norm"] - b["norm"]) <= 1e-5 * b["norm"], (a, b)


@pytest.mark.timeout(300)
def test_hf_export_round_trip_from_tp_shards(rank_pool, tmp_path) -> None:
    assert rank_pool.run(2, check_hf_export_round_trip, 2, str(tmp_path), timeout_s=240) == [
        "ok",
        "ok",
    ]
