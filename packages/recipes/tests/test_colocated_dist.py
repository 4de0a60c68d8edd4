"""Colocated loaders under SPMD: one energon-sft loader per data-parallel replica, on its first
rank, and its cp peer trains on the same samples; the data plane lists exactly the samples the
loader yields, each once in an epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _controller_workers import loader_sample_ids, run_sft_plane_on_rank
from conftest import unshuffled_cpu_run
from train_recipes.data.demo import DemoSplit
from train_recipes.data.plane import DataPlane

EPOCH_STEPS = 12  # 96 samples / batches of 8, one replica


@pytest.mark.timeout(300)
def test_cp2_builds_one_loader_per_replica_and_the_plane_lists_one_epoch(
    rank_pool: object, epoch_data: DemoSplit, tmp_path: Path
) -> None:
    reports = rank_pool.run(  # type: ignore[attr-defined]
        2,
        run_sft_plane_on_rank,
        unshuffled_cpu_run(epoch_data, tmp_path / "cp2", EPOCH_STEPS).but(cp=2).overrides(),
        timeout_s=240,
    )
    # Rank 0 (cp=0) owns the replica's loader; its cp peer built none.
    assert [r["loaders_built"] for r in reports] == [1, 0]
    planes = []
    for report in reports:
        plane = DataPlane(dp_size=1)
        plane.load_state_dict(report["plane"])
        planes.append(plane)
    assert planes[0].steps() == list(range(1, EPOCH_STEPS + 1))
    trained = [planes[0].list_sample_ids(s) for s in planes[0].steps()]
    assert [planes[1].list_sample_ids(s) for s in planes[1].steps()] == trained, (
        "the cp peers trained on different samples"
    )
    # The same samples, in the same order, as an energon-sft loader built directly.
    expected = loader_sample_ids(
        str(epoch_data.energon_dir), dp_rank=0, dp_size=1, shards=2, batches=EPOCH_STEPS, cp=2
    )
    assert trained == expected
    # One epoch: every training chat exactly once, none lost, none repeated.
    ids = [i for step in trained for i in step]
    rows = epoch_data.train_jsonl.read_text().splitlines()
    assert len(ids) == len(rows) == len(set(ids)), (len(ids), len(set(ids)), len(rows))
    assert all(json.loads(r)["messages"] for r in rows)
