"""The hf-vs-megatron SFT step benchmark keeps working (`--quick`: tiny model, CPU, subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "megatron_step.py"

pytest.importorskip("megatron.core", reason="megatron-core is the megatron extra's dependency")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_megatron_step_quick(tmp_path: Path) -> None:
    result = run_quick(BENCH, tmp_path, timeout_s=280).report
    assert [r["variant"] for r in result["rows"]] == ["hf", "megatron"]
    for row in result["rows"]:
        assert row["tokens/s"] > 0 and row["vs hf"] > 0, row
    assert result["meta"]["megatron-core"] == "0.16.1"
