"""Expert-parallel parameters through the Engine on gloo ranks: exact scaling under the
token-sum contract (unequal tokens, accumulation), synced and clipped with the dense ones."""

from __future__ import annotations

import pytest

import _expert_workers as w


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["fsdp2"])
def test_expert_gradients_match_single_process_reference(rank_pool, kind: str) -> None:
    counts = [[3, 1], [0, 5]]  # unequal tokens per rank, an empty micro-batch, accumulation 2
    want = w.reference(counts, seed=3)
    results = rank_pool.run(2, w.run, kind, counts, 3, timeout_s=150)
    for got in results:
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-5)
        assert set(got["params"]) == set(want["params"])
        for name, value in want["params"].items():
            err = float((got["params"][name] - value).abs().max())
            assert err < 1e-6, f"{kind} {name}: max |param - ref| = {err:.3e}"


@pytest.mark.timeout(300)
def test_dp4_ep2_sums_expert_gradients_over_replicas(rank_pool) -> None:
    counts = [[3, 1], [0, 5], [2, 2], [4, 0]]  # 2 ep groups of 2; experts on 2 ranks each
    want = w.reference(counts, seed=5)
    results = rank_pool.run(4, w.run, "fsdp2", counts, 5, 2, timeout_s=240)
    for got in results:
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-5)
        for name, value in want["params"].items():
            err = float((got["params"][name] - value).abs().max())
            assert err < 1e-6, f"{name}: max |param - ref| = {err:.3e}"


def test_expert_shards_reject_empty_and_ddp() -> None:
    from torch import nn

    from train_engine import DDPConfig, ExpertShards, apply_data_parallel

    with pytest.raises(ValueError, match="at least one"):
        ExpertShards(params=())
    model = nn.Linear(2, 2)
    shards = ExpertShards(params=(model.weight,))
    with pytest.raises(NotImplementedError, match="FSDP2Config"):
        apply_data_parallel(model, mesh=None, config=DDPConfig(), expert_shards=shards)  # type: ignore[arg-type]
