"""The MoE SFT-step benchmark keeps working (`--quick`: tiny model, CPU, subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "moe_step.py"


@pytest.mark.timeout(200)
def test_moe_step_quick(tmp_path: Path) -> None:
    out = tmp_path / "moe_step.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["hf-loop", "hf-grouped", "converted"]
    for row in rows:
        assert "error" not in row and row["tokens/s"] > 0, row
    # Same weights and batch: the converted model trains the same function.
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) < 1e-4, losses
