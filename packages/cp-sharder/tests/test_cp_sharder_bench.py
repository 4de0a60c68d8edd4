"""Keeps the benchmark script runnable (CI runs it with --quick; no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "portable_cp.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_quick_runs_and_writes_json(tmp_path: Path) -> None:
    # The plain model keeps the subprocesses free of the transformers import (CI time); the
    # transformers path is covered by the parity tests.
    run = run_quick(BENCH, tmp_path, "--model", "plain", timeout_s=280)
    report = run.report
    assert [r["variant"] for r in report["rows"]] == ["no_cp", "cp1", "cp2_portable"]
    assert all(r["median_ms"] > 0 for r in report["rows"])
    assert report["model"] == "plain"
    assert "cp2_portable" in run.stdout


PACKED_BENCH = Path(__file__).parents[1] / "bench" / "packed.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_packed_bench_quick_runs_and_its_variants_agree(tmp_path: Path) -> None:
    rows = run_quick(PACKED_BENCH, tmp_path, timeout_s=280).report["rows"]
    assert [r["variant"] for r in rows] == ["unpacked", "dense_mask", "varlen"]
    # The same documents in every variant: the same token-sum loss (fp32).
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses
