"""The benchmark script keeps working (--quick, in a subprocess); no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "loader_bench.py"


@pytest.mark.timeout(240)
def test_bench_quick_runs_and_writes_json(tmp_path: Path) -> None:
    if not BENCH.is_file():
        pytest.skip(f"bench script not shipped here ({BENCH}); it lives in the source tree")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {r["loader"] for r in report["throughput"]} == {"energon-sft", "torch DataLoader"}
    assert all(r["samples_per_s"] > 0 for r in report["throughput"])
    assert [r["shuffle_buffer"] for r in report["resume"]] == [0, 8]
    assert "samples/s" in proc.stdout and "restore -> first batch" in proc.stdout
