"""The benchmark script keeps running (tiny sizes); its timings are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "dispatch_throughput.py"


@pytest.mark.timeout(120)
@pytest.mark.skipif(not BENCH.exists(), reason="bench folder not shipped with this install")
def test_bench_quick_runs_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    variants = [row["variant"] for row in report["rows"]]
    assert variants == ["naive-loop", "all-to-all", "all-to-all+equal", "equalize-only"]
    assert all(row["median_ms"] > 0 for row in report["rows"])
    assert "naive-loop" in proc.stdout and report["versions"]["torch"]
