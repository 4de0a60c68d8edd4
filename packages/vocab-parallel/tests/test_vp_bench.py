"""The benchmark script keeps working (tiny sizes); it is never used for timing claims here."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "log_probs.py"


@pytest.mark.timeout(180)
def test_bench_quick_runs_and_writes_json(tmp_path: Path) -> None:
    run = run_quick(BENCH, tmp_path, "--device", "cpu", timeout_s=170)
    assert "x floor" in run.stdout
    report = run.report
    names = [row["variant"] for row in report["rows"]]
    assert names == ["naive", "ours", "naive_linear", "fused_linear"], names
    assert report["floor_ms"] > 0 and report["device"] == "cpu"
    for row in report["rows"]:
        assert row["median_ms"] > 0 and row["speedup"] > 0
        assert row["peak_extra_gib"] is None  # memory is reported on CUDA only
