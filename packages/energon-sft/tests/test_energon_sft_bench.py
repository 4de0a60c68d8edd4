"""The benchmark script keeps working (--quick, in a subprocess); no timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "loader_bench.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_quick_runs_and_writes_json(tmp_path: Path) -> None:
    run = run_quick(BENCH, tmp_path, timeout_s=220)
    report = run.report
    assert {r["loader"] for r in report["throughput"]} == {"energon-sft", "torch DataLoader"}
    assert all(r["samples_per_s"] > 0 for r in report["throughput"])
    assert [r["shuffle_buffer"] for r in report["resume"]] == [0, 8]
    assert "samples/s" in run.stdout and "restore -> first batch" in run.stdout
