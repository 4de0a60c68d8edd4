"""Keeps the benchmark script runnable (CI runs it with --quick; no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "portable_cp.py"


@pytest.mark.timeout(300)
@pytest.mark.skipif(not BENCH.exists(), reason="bench folder not present (installed wheel)")
def test_bench_quick_runs_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        # The plain model keeps the subprocesses free of the transformers import (CI time); the
        # transformers path is covered by the parity tests.
        [sys.executable, str(BENCH), "--quick", "--model", "plain", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["variant"] for r in report["rows"]] == ["no_cp", "cp1", "cp2_portable"]
    assert all(r["median_ms"] > 0 for r in report["rows"])
    assert report["model"] == "plain"
    assert "cp2_portable" in proc.stdout


PACKED_BENCH = Path(__file__).parents[1] / "bench" / "packed.py"


@pytest.mark.timeout(300)
@pytest.mark.skipif(not PACKED_BENCH.exists(), reason="bench folder not present (installed wheel)")
def test_packed_bench_quick_runs_and_its_variants_agree(tmp_path: Path) -> None:
    out = tmp_path / "packed.json"
    proc = subprocess.run(
        [sys.executable, str(PACKED_BENCH), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["unpacked", "dense_mask", "varlen"]
    # The same documents in every variant: the same token-sum loss (fp32).
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses
