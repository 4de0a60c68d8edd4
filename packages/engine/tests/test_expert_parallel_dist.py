"""Expert-parallel parameters through the Engine on gloo ranks: exact scaling under the
token-sum contract (unequal tokens, accumulation), synced and clipped with the dense ones."""

from __future__ import annotations

import pytest
import torch

import _expert_workers as w


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
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
@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_dp4_ep2_sums_expert_gradients_over_replicas(rank_pool, kind: str) -> None:
    counts = [[3, 1], [0, 5], [2, 2], [4, 0]]  # 2 ep groups of 2; experts on 2 ranks each
    want = w.reference(counts, seed=5)
    results = rank_pool.run(4, w.run, kind, counts, 5, 2, timeout_s=240)
    for got in results:
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-5)
        for name, value in want["params"].items():
            err = float((got["params"][name] - value).abs().max())
            assert err < 1e-6, f"{name}: max |param - ref| = {err:.3e}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "world"), [("fsdp2", 2), ("ddp", 4)])
def test_checkpoint_keeps_every_ep_ranks_experts(
    rank_pool, tmp_path, kind: str, world: int
) -> None:
    """Saved at ep=2 (on 4 ranks: 2 replicas of each expert), reloaded at ep=2 into other
    weights and in one process holding all experts: parameters and Adam moments equal."""
    directory = str(tmp_path / "ckpt")
    results = rank_pool.run(world, w.save_and_reload, kind, 7, 2, directory, timeout_s=240)
    saved = results[0]["saved"]
    # Each ep rank's experts differ (otherwise a checkpoint of one rank's would pass).
    half = w.EXPERTS // 2
    assert not torch.equal(saved["experts"][:half], saved["experts"][half:])
    for got in results:
        for name, value in saved.items():
            assert torch.equal(got["loaded"][name], value), f"{kind} {name} after reload"
        assert torch.equal(got["loaded_moments"], results[0]["saved_moments"])
    alone = w.load_in_one_process(directory, seed=8, blocks=kind == "fsdp2")
    for name, value in saved.items():
        assert torch.equal(alone["params"][name], value), f"{name} loaded in one process"
    assert torch.equal(alone["moments"], results[0]["saved_moments"])


def test_expert_shards_reject_empty() -> None:

    from train_engine import ExpertShards

    with pytest.raises(ValueError, match="at least one"):
        ExpertShards(params=())


def test_ddp_ignores_root_and_nested_expert_parameters_under_both_spellings() -> None:
    """DDP's reducer names a root parameter ``.name``: without that spelling in the ignore
    list, DDP all-reduces it (the cause of the wrong DDP expert gradients)."""
    from torch import nn

    from train_engine.expert_parallel import ddp_ignored_names

    model = nn.Module()
    model.experts = nn.Parameter(torch.zeros(2))
    model.block = nn.Linear(2, 2)
    names = ddp_ignored_names(model, {model.experts, model.block.weight})
    assert names == [".experts", "block.weight", "experts"]
