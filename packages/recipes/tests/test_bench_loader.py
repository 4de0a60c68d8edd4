"""The loader-vs-step benchmark keeps working (`--quick`: tiny images and model, CPU, subprocess)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"


@pytest.mark.timeout(300)
def test_loader_vs_step_quick(tmp_path: Path) -> None:
    script = BENCH / "loader_vs_step.py"
    if not script.is_file():
        pytest.skip(f"bench folder not shipped here ({BENCH}); the scripts live in the repository")
    out = tmp_path / "loader_vs_step.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loader / step samples/s" in proc.stdout, proc.stdout
    result = json.loads(out.read_text())

    meta = result["meta"]
    for key in ("torch", "transformers", "device_name", "num_workers", "cpu_count", "dataset"):
        assert key in meta, sorted(meta)
    assert meta["num_workers"] == 1
    assert meta["sft_config"]["data"]["model_family"] == "qwen2_5_vl"
    assert meta["sft_config"]["data"]["packing"] is True

    loader, step = result["rows"]
    assert loader["variant"].startswith("loader") and step["variant"].startswith("SFT step")
    for row in (loader, step):
        for key in ("samples/s", "tokens/s", "ms/batch", "samples/batch", "tokens/batch"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    # Packed rows: several samples per row, and every batch carries images.
    assert loader["samples/batch"] > meta["args"]["micro_batch_size"], loader
    assert loader["images/batch"] > 0 and step["images/batch"] > 0
    assert all(math.isfinite(v) for v in step["loss/token first, last"])

    ratio = result["ratio"]
    assert math.isclose(ratio["samples_per_s"], loader["samples/s"] / step["samples/s"])
    assert isinstance(ratio["keeps_gpu_fed"], bool)
