"""The end-to-end SFT step benchmark keeps working (`--quick`: tiny model, CPU, subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "sft_step.py"


@pytest.mark.timeout(300)
def test_sft_step_quick(tmp_path: Path) -> None:
    out = tmp_path / "sft_step.json"
    variants = "fsdp2,fsdp2+compile,recipes,recipes-hf-mask,recipes-cp1"
    command = [sys.executable, str(BENCH), "--quick", "--variants", variants]
    proc = subprocess.run(
        [*command, "--sdpa", "flash,math", "--profile", "recipes", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == variants.split(",")
    for row in result["rows"]:
        assert row["tokens/s"] > 0 and row["vs fsdp2+compile"] > 0, row
    assert "aten::" in (tmp_path / "profile_recipes.txt").read_text()
