"""Topology mapper (pure), owner -> peers batch broadcast and the zero-token guard on gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from _esft_data import build_dataset, chat_rows
from _esft_workers import (
    check_owner_broadcast,
    check_owner_failure_reaches_peers,
    check_restore_refusal_is_agreed,
)
from energon_sft import TopologyMapper, logical_shards_for


def test_mapper_layout_owners_and_logical_shards() -> None:
    m = TopologyMapper(dp=2, cp=2, tp=2, pp=1, num_logical_shards=4)
    assert m.world_size == 8
    # tp fastest, then cp, then dp.
    assert m.coords(5) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0}
    assert [m.rank_of(**m.coords(r)) for r in range(8)] == list(range(8))
    assert [m.loader_owner(d) for d in range(2)] == [0, 4]
    assert m.replica_ranks(1) == [4, 5, 6, 7]
    assert m.peers(4) == [5, 6, 7] and m.peers(5) == []
    assert [m.is_loader_owner(r) for r in range(8)] == [r in (0, 4) for r in range(8)]
    assert m.logical_shards(1) == [2, 3]
    assert (
        m.placement_hash()
        == TopologyMapper(dp=2, cp=2, tp=2, num_logical_shards=4).placement_hash()
    )
    assert m.placement_hash() != TopologyMapper(dp=2, cp=2, tp=2).placement_hash()
    assert (
        m.placement_hash()
        != TopologyMapper(
            dp=2, cp=2, tp=2, num_logical_shards=4, order=("cp", "tp", "dp", "pp")
        ).placement_hash()
    )
    assert logical_shards_for(3, 4, 8) == [6, 7]
    with pytest.raises(ValueError, match=r"resume on dp sizes \[1, 2, 4\]"):
        logical_shards_for(0, 3, 4)


@pytest.fixture(scope="module")
def text_ds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_dataset(tmp_path_factory.mktemp("dist"), chat_rows(24, image_every=0))


@pytest.mark.timeout(240)
def test_owner_broadcasts_batches_to_its_peers(rank_pool: Any, text_ds: Path) -> None:
    ds = text_ds
    # World 2 = one replica (dp=1, tp=2); that replicas read different data is covered by
    # the logical-shard tests of test_loader.py without spawning 4 ranks.
    results = rank_pool.run(2, check_owner_broadcast, str(ds), timeout_s=200)
    by_dp: dict[int, set[str]] = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], set()).add(r["hash"])
    assert all(len(h) == 1 for h in by_dp.values()), "peers must receive the owner's batches"
    assert len({r["placement"] for r in results}) == 1
    assert sum(r["owner"] for r in results) == 1
    assert len(set(results[0]["digests"])) == 3, "three distinct batches were broadcast"


def test_owner_failure_and_end_reach_every_peer(rank_pool: Any) -> None:
    results = rank_pool.run(2, check_owner_failure_reaches_peers, timeout_s=120)
    for r in results:
        assert r["first"] == {"step": 0}
        assert r["error"] == "the loader on rank 0 failed: ValueError: disk on fire"
        assert r["stopped"]
        assert r["no_iterator"] == (
            "the loader on rank 0 failed: ValueError: rank 0 owns the replica's loader but "
            "has no iterator"
        )


def test_a_refused_restore_on_one_rank_raises_on_all(rank_pool: Any, text_ds: Path) -> None:
    results = rank_pool.run(2, check_restore_refusal_is_agreed, str(text_ds), timeout_s=120)
    assert results[0]["raised"] and "other rank(s) refused" in results[0]["msg"]
    assert results[1]["raised"] and "batch_size: 3 -> 2" in results[1]["msg"]
