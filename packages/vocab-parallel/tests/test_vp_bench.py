"""The benchmark script keeps working (tiny sizes); it is never used for timing claims here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "log_probs.py"


@pytest.mark.timeout(180)
def test_bench_quick_runs_and_writes_json(tmp_path: Path) -> None:
    if not BENCH.exists():
        pytest.skip(f"benchmark script not shipped here ({BENCH} is absent)")
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "x floor" in result.stdout
    report = json.loads(out.read_text())
    names = [row["variant"] for row in report["rows"]]
    assert names == ["naive", "ours", "naive_linear", "fused_linear"], names
    assert report["floor_ms"] > 0 and report["device"] == "cpu"
    for row in report["rows"]:
        assert row["median_ms"] > 0 and row["speedup"] > 0
        assert row["peak_extra_gib"] is None  # memory is reported on CUDA only
