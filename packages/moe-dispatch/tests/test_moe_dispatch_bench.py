"""The benchmark script keeps running (tiny sizes); its timings are not checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "dispatch_throughput.py"


@pytest.mark.timeout(120)
def test_bench_quick_runs_and_writes_json(tmp_path: Path) -> None:
    run = run_quick(BENCH, tmp_path, out_flag="--json", timeout_s=110)
    report = run.report
    variants = [row["variant"] for row in report["rows"]]
    assert variants == ["naive-loop", "all-to-all", "all-to-all+equal", "equalize-only"]
    assert all(row["median_ms"] > 0 for row in report["rows"])
    assert "naive-loop" in run.stdout and report["versions"]["torch"]
