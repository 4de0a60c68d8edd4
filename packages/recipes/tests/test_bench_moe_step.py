"""The MoE SFT-step benchmark keeps working (`--quick`: tiny model, CPU, subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "moe_step.py"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_moe_step_quick(tmp_path: Path) -> None:
    rows = run_quick(BENCH, tmp_path, timeout_s=180).report["rows"]
    assert [r["variant"] for r in rows] == ["hf-loop", "hf-grouped", "converted"]
    for row in rows:
        assert "error" not in row and row["tokens/s"] > 0, row
    # Same weights and batch: the converted model trains the same function.
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) < 1e-4, losses
