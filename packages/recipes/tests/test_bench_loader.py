"""The loader-vs-step benchmark keeps working (`--quick`: tiny images and model, CPU, subprocess)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "loader_vs_step.py"


@pytest.mark.timeout(300)
def test_loader_vs_step_quick(tmp_path: Path) -> None:
    run = run_quick(BENCH, tmp_path, "--device", "cpu", timeout_s=240)
    assert "loader / step samples/s" in run.stdout, run.stdout
    result = run.report

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
