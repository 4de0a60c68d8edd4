"""Distributed tests on real gloo processes: HF parity with and without CP, token verbs, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _cps_workers as workers

# fp32 CP against a float64 no-CP reference.
LOSS_TOL = 1e-5
GRAD_TOL = 2e-5


def _check(results: dict[str, dict[str, Any]], label: str) -> None:
    for case, r in results.items():
        assert r["loss_rel_err"] < LOSS_TOL, f"{label}/{case}: loss differs: {r}"
        assert r["grad_rel_err"] < GRAD_TOL, f"{label}/{case}: gradients differ: {r}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_hf_models_match_no_cp(rank_pool: Any, world_size: int) -> None:
    """Llama, Qwen2 and Qwen3 (with a sliding-window layer): (a) batch 2, length 13 with left
    padding, (b) packed documents (TE partition and unpadded), (c) inputs_embeds."""
    for arch in ("llama", "qwen2", "qwen3_sliding"):
        results = rank_pool.run(world_size, workers.hf_parity, arch, timeout_s=300)
        for rank_result in results:
            _check(rank_result, f"{arch} cp={world_size}")
        first = results[0]
        assert first["bshd"]["padded_len"] == 16  # 13 rounded up to a multiple of 2*cp
        assert first["thd_padded"]["layout"] == "thd"
        assert first["thd_unpadded"]["layout"] == "head_tail"


@pytest.mark.timeout(200)
def test_running_without_train_ctx_is_detected(rank_pool: Any) -> None:
    """The parity test can fail: without the CP attention the loss is far off."""
    for r in rank_pool.run(2, workers.no_context_control):
        assert r["loss_rel_err"] > 5 * LOSS_TOL, r
        assert r["grad_rel_err"] > 100 * GRAD_TOL, r


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 4])
def test_token_verbs_round_trip_and_route_gradients(rank_pool: Any, world_size: int) -> None:
    results = rank_pool.run(world_size, workers.token_verbs)
    for r in results:
        for case in ("bshd", "thd"):
            assert r[f"{case}_roundtrip_err"] == 0.0, r
            assert r[f"{case}_grad_err"] < 1e-12, r
        padded = 12 if world_size == 2 else 16  # 11 rounded up to a multiple of 2*cp
        assert r["bshd_local_len"] == padded // world_size
        assert r["thd_local_len"] == 32 // world_size
    # A model hook asking for the contiguous layout: 10 tokens padded to a multiple of cp.
    for rank, r in enumerate(results):
        local = 10 // world_size + (1 if world_size == 4 else 0)  # P = 10 (cp=2) or 12 (cp=4)
        assert r["hook_indices"] == list(range(rank * local, (rank + 1) * local)), r
        pad = [0] * local
        want = [*range(10), *pad][rank * local : (rank + 1) * local]
        assert r["hook_ids"] == want, r
        assert r["hook_roundtrip_err"] == 0.0, r


@pytest.mark.timeout(200)
def test_plain_pytorch_model_through_sdpa_override(rank_pool: Any) -> None:
    for r in rank_pool.run(2, workers.plain_sdpa_parity):
        assert r["loss_rel_err"] < LOSS_TOL and r["grad_rel_err"] < GRAD_TOL, r
        assert r["sdpa_restored"] == 1.0


@pytest.mark.timeout(200)
def test_padding_fills_rotary_and_extra_buffers(rank_pool: Any) -> None:
    results = rank_pool.run(2, workers.batch_prep)
    r = results[0]
    # Only keys the forward names, plus labels; attention_mask is consumed by the sharder.
    assert r["keys"] == ["input_ids", "labels", "padding_mask", "position_ids", "teacher"]
    ids = torch.arange(1, 15).reshape(2, 7)
    assert torch.equal(r["ids"], torch.cat([ids, torch.full((2, 1), -7)], dim=1))
    assert torch.equal(r["labels"], torch.cat([ids + 100, torch.full((2, 1), -100)], dim=1))
    assert torch.equal(r["padding_mask"][:, 7], torch.tensor([True, True]))
    assert not bool(r["padding_mask"][:, :7].any())
    assert torch.equal(r["attention_mask"][:, 7], torch.tensor([0, 0]))
    # Rotary [3, B, S] positions sharded on the last dim and continued over the pad.
    for axis in range(3):
        scale = axis + 1
        want = torch.cat([torch.arange(7) * scale, torch.tensor([6 * scale + 1])])
        assert torch.equal(r["position_ids"][axis], want.expand(2, 8)), axis
    torch.testing.assert_close(r["teacher"], r["teacher_in"])
    # Rank r holds chunks r and 3-r of 4 (head/tail) of the padded length 8.
    assert results[0]["indices"].tolist() == [0, 1, 6, 7]
    assert results[1]["indices"].tolist() == [2, 3, 4, 5]
    assert torch.equal(results[1]["local_ids"], ids[:, 2:6])


@pytest.mark.timeout(200)
def test_ranks_with_different_batches_all_raise(rank_pool: Any) -> None:
    (shape0, invalid0), (shape1, invalid1) = rank_pool.run(2, workers.disagreeing_batches)
    assert "ranks disagree" in shape0 and "ranks disagree" in shape1
    # Rank 1's labels are too short: it reports that, rank 0 learns the ranks disagree.
    assert "ranks disagree" in invalid0, invalid0
    assert "batch['labels'] has length 5" in invalid1, invalid1


@pytest.mark.timeout(200)
def test_mesh_and_missing_te_errors(rank_pool: Any) -> None:
    for wrong_size, wrong_rank, te_missing in rank_pool.run(2, workers.mesh_errors):
        assert "the cp mesh has 3 ranks but its process group has 2" in wrong_size
        assert "does not match the process group" in wrong_rank
        assert "pip install 'cp-sharder[te]'" in te_missing


@pytest.mark.timeout(200)
def test_two_dimensional_mesh_binds_cp_and_counts_over_dp(rank_pool: Any) -> None:
    results = rank_pool.run(4, workers.two_d_mesh)
    for rank, r in enumerate(results):
        assert r["cp_size"] == 2 and r["cp_rank"] == rank % 2, r
        assert r["roundtrip_err"] == 0.0, r
    # dp replica 0 ignores 1 label per row, replica 1 ignores 2: 16 + 14 tokens in all.
    assert [r["local_count"] for r in results] == [16, 16, 14, 14]
    assert all(r["dp_count"] == 30 for r in results), results
