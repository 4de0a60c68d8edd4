"""Distributed behaviour of the Engine on real gloo ranks: invariance, deferral, clipping,
non-finite agreement, setup validation, token counts over dp only."""

from __future__ import annotations

import math

import pytest
import torch

import _engine_workers as w
from _engine_models import reference_sgd_run

STEPS, SEED = 3, 21


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "fsdp2_sum"])
def test_split_invariance_matches_single_process_reference(rank_pool, kind: str) -> None:
    """Same global batch as (1 rank x 4 micro), (2 x 2), (4 x 1), uneven tokens, contract (b)."""
    reference = reference_sgd_run(
        steps=STEPS, n_seq=w.N_SEQ, lr=0.1, momentum=0.9, max_grad_norm=0.5, data_seed=SEED
    )
    finals = {}
    for world, micro in [(1, 4), (2, 2), (4, 1)]:
        results = rank_pool.run(world, w.invariance, kind, micro, STEPS, SEED, timeout_s=180)
        for r in results[1:]:
            assert _max_diff(r["params"], results[0]["params"]) == 0.0, "ranks disagree"
        finals[(world, micro)] = results[0]
        err = _max_diff(results[0]["params"], reference)
        assert err < 2e-6, f"{kind} world={world} micro={micro}: max |param - ref| = {err:.3e}"
    norms = [f["norms"] for f in finals.values()]
    for other in norms[1:]:
        assert other == pytest.approx(norms[0], rel=1e-5), norms


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_no_gradient_collective_before_last_micro_batch(rank_pool, kind: str) -> None:
    deferred = rank_pool.run(2, w.deferral, kind, True)
    eager = rank_pool.run(2, w.deferral, kind, False)
    for rank in range(2):
        counts = deferred[rank]["per_backward"]
        assert counts[0] == 0 and counts[1] == 0 and counts[2] > 0, (
            f"{kind} rank {rank}: gradient collectives per backward {counts}, expected 0, 0, >0"
        )
        assert all(c > 0 for c in eager[rank]["per_backward"]), eager[rank]["per_backward"]
    # Deferring changes communication, not the result.
    assert _max_diff(deferred[0]["params"], eager[0]["params"]) < 1e-6


@pytest.mark.timeout(200)
def test_clip_parity_ddp_and_fsdp2(rank_pool) -> None:
    cases = [
        ("ddp", 2.0, False),
        ("ddp", 2.0, True),
        ("ddp", math.inf, True),
        ("fsdp2", 2.0, False),
        ("fsdp2", math.inf, False),
    ]
    for kind, norm_type, bucket_view in cases:
        results = rank_pool.run(2, w.clip_parity, kind, norm_type, bucket_view)
        for rank, r in enumerate(results):
            label = f"{kind} p={norm_type} bucket_view={bucket_view} rank {rank}"
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), label
            assert r["norm"] > 0.05, f"{label}: the test must actually clip"
            err = _max_diff(r["params"], r["ref_params"])
            assert err < 1e-6, f"{label}: clipped update differs from clip_grad_norm_ by {err:.3e}"
            if kind == "ddp":
                assert r["norm_collectives"] == 0, f"{label}: DDP fast path ran a collective"
                assert r["aliases_buckets"] is bucket_view, label
                assert r["aliases_buckets_again"] is bucket_view, label
                assert r["clipped_in_place"], f"{label}: clipping replaced the gradient tensors"
            else:
                assert r["norm_collectives"] == 1, f"{label}: {r['norm_collectives']} all-reduces"


@pytest.mark.timeout(200)
def test_clip_parity_fsdp2_with_tensor_parallel_2d_mesh(rank_pool) -> None:
    for norm_type in (2.0, math.inf):
        results = rank_pool.run(4, w.clip_parity, "fsdp2_tp", norm_type)
        for rank, r in enumerate(results):
            label = f"fsdp2+tp p={norm_type} rank {rank}"
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), label
            err = _max_diff(r["params"], r["ref_params"])
            assert err < 1e-6, f"{label}: clipped update differs from clip_grad_norm_ by {err:.3e}"
            # dp-mesh norms: one reduction; 2-D (dp, tp) TP weights: one per mesh dimension.
            assert r["norm_collectives"] == 3, f"{label}: {r['norm_collectives']} all-reduces"


@pytest.mark.timeout(200)
def test_nonfinite_on_one_rank_is_agreed_by_all(rank_pool) -> None:
    cases = [(k, p, False) for k in ("local", "ddp", "fsdp2") for p in ("skip", "raise")]
    cases += [("ddp", "skip", True), ("fsdp2", "skip", True)]  # skipped on the device
    for kind, policy, fused in cases:
        results = rank_pool.run(2, w.nonfinite, kind, policy, fused)
        for rank, r in enumerate(results):
            label = f"{kind}/{policy}/fused={fused} rank {rank}: {r}"
            if policy == "skip":
                assert r["skipped"] and not r["updated"], label
            else:
                assert "non-finite global gradient norm" in r["raised"], label
            assert r["unchanged"] and r["optimizer_steps"] == 0, label
            assert r["lr"] == 0.1, f"{label}: the scheduler stepped on a skipped window"
            assert r["grads_cleared"] and r["next_updated"], label
    # "step" applies the update anyway: the non-finite rank's parameters are no longer finite.
    results = rank_pool.run(2, w.nonfinite, "local", "step")
    assert results[1]["updated"] and not results[1]["unchanged"]


@pytest.mark.timeout(120)
def test_setup_validation_blocks_and_param_groups(rank_pool) -> None:
    r = rank_pool.run(2, w.setup_checks)[0]
    errors = r["errors"]
    assert "static_graph=True" in errors["static_graph_accum"]
    assert "no_sync" in errors["static_graph_accum"]
    assert "bucket_cap_mb must be > 0" in errors["bucket_cap"]
    assert "DDPConfig or FSDP2Config" in errors["bad_config"]
    assert "FSDP2Config.param_dtype='fp8' is not a dtype" in errors["bad_dtype_name"]
    assert r["named_dtypes"] == ("torch.float32", "torch.float64"), r["named_dtypes"]
    assert "static_graph=False" in errors["engine_static_graph"]
    assert "call engine(...) instead of model(...)" in errors["ddp_forward_bypass"]
    assert "Finish the window" in errors["fsdp2_mid_window_zero_grad"]
    assert r["blocks_sharded"]
    assert r["grad_average_size"] == 2
    assert r["summed_size"] == 1.0, "a custom FSDP2 divide factor must replace the dp size"
    assert "different gradient divide factors" in errors["mixed_divide_factors"]
    decay = r["decay_of"]
    assert decay["layers.0.w1.weight"] == 0.1 and decay["head.weight"] == 0.1
    assert decay["layers.0.w1.bias"] == 0.0 and decay["layers.1.norm.weight"] == 0.0


@pytest.mark.timeout(120)
def test_tokens_summed_over_dp_only_and_loss_window(rank_pool) -> None:
    results = rank_pool.run(4, w.dp_cp_tokens_and_window)
    for rank, r in enumerate(results):
        assert r["grad_average_size"] == 4, r
        assert r["tokens"] == 10 + 15, f"rank {rank}: dp-only token sum {r['tokens']} != 25"
        assert r["first"] is None and r["len"] == 3
        # losses rank + 10*step for steps 2, 3, 4; mean over ranks 0..3 and the window
        expected = sum(rk + 10 * s for rk in range(4) for s in (2, 3, 4)) / 12
        assert r["average"] == pytest.approx(expected)
        assert r["last"] == pytest.approx(sum(rk + 40 for rk in range(4)) / 4)
        # contract (b): per-step sums over the 4 ranks' parts, divided by the 25 global tokens
        sums = [sum(0.5 * s * (rk + 1) for rk in range(4)) for s in (1, 2)]
        assert r["token_mean_last"] == pytest.approx(sums[1] / 25), (rank, r)
        assert r["token_mean_average"] == pytest.approx((sums[0] + sums[1]) / 2 / 25), (rank, r)


def test_tiny_reference_is_not_trivially_matched() -> None:
    """Guard for the invariance test: a different split contract would move the parameters."""
    a = reference_sgd_run(steps=2, n_seq=8, lr=0.1, momentum=0.9, max_grad_norm=0.5, data_seed=1)
    b = reference_sgd_run(steps=2, n_seq=8, lr=0.1, momentum=0.9, max_grad_norm=0.5, data_seed=2)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-4
    assert all(torch.isfinite(v).all() for v in a.values())


@pytest.mark.timeout(120)
def test_grad_norm_uneven_empty_partial_and_mixed_shards(rank_pool) -> None:
    for r in rank_pool.run(2, w.norm_edge_cases):
        for p in (2.0, 1.0, math.inf):
            got, expected = r[p]
            assert got == pytest.approx(expected, rel=1e-6), (p, got, expected)
        assert r["coef"] < 1 and r["clip_err"] < 1e-6, r
