"""The loader-vs-step benchmark keeps working (`--quick`: tiny images and model, CPU, subprocess)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "loader_vs_step.py"


@pytest.mark.slow  # ~30 s on 2 cores: the per-package (isolated) CI sessions skip it
@pytest.mark.timeout(300)
def test_loader_vs_step_quick(tmp_path: Path) -> None:
    # Two step variants: transformers' per-window vision attention with the loss over every
    # position, and everything switched on (varlen vision attention, matmul patch embedding,
    # fused AdamW, compiled blocks with aot_eager on the CPU, FSDP2, the trained rows only).
    variants = "stock+allpositions,varlen+linearpatch+fusedadam+compile+fsdp2"
    run = run_quick(BENCH, tmp_path, "--device", "cpu", "--step-variants", variants, timeout_s=240)
    assert "loader / step samples/s" in run.stdout, run.stdout
    assert "MFU" in run.stdout, run.stdout
    result = run.report

    meta = result["meta"]
    for key in ("torch", "transformers", "device_name", "num_workers", "cpu_count", "dataset"):
        assert key in meta, sorted(meta)
    assert meta["num_workers"] == 1
    assert meta["sft_config"]["data"]["model_family"] == "qwen2_5_vl"
    assert meta["sft_config"]["data"]["packing"] is True

    loader, stock, tuned = result["rows"]
    assert loader["variant"].startswith("loader")
    assert [stock["variant"], tuned["variant"]] == [
        "step stock+allpositions",
        "step varlen+linearpatch+fusedadam+compile+fsdp2",
    ]
    assert "over trained rows" in tuned["setup"] and "over trained rows" not in stock["setup"]
    assert tuned["loss over trained rows only"] and not stock["loss over trained rows only"]
    assert 0 < tuned["trained/positions"] < 1, tuned["trained/positions"]
    assert "vision per window" in stock["setup"] and "vision varlen" in tuned["setup"]
    assert tuned["compiled blocks"] > 0 and "fsdp2" in tuned["setup"], tuned["setup"]
    assert "fused AdamW" in tuned["setup"] and "fused AdamW" not in stock["setup"]
    assert "patch embedding matmul" in tuned["setup"] and "Conv3d" in stock["setup"]
    for row in (loader, stock, tuned):
        for key in ("samples/s", "tokens/s", "ms/batch", "samples/batch", "tokens/batch"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    # Packed rows: several samples per row, and every batch carries images.
    assert loader["samples/batch"] > meta["args"]["micro_batch_size"], loader
    assert loader["images/batch"] > 0 and stock["images/batch"] > 0
    for step in (stock, tuned):
        assert all(math.isfinite(v) for v in step["loss/token first, last"])
        assert step["fused loss"], "token_sum_loss(vlm=True) did not take the fused loss"
        # MFU from the model FLOPs: every part counted, consistent with the step time.
        parts = step["TFLOP/batch by part"]
        assert all(v > 0 for v in parts.values()), parts
        assert math.isclose(sum(parts.values()), step["model TFLOP/batch"])
        assert math.isclose(step["TFLOP/s"], step["model TFLOP/batch"] / step["ms/batch"] * 1e3)
        assert math.isclose(step["MFU"], step["TFLOP/s"] / meta["peak_tflops"])
    # Same seed, same first batch: the variants' first losses agree (bf16 compute in both).
    assert math.isclose(stock["first loss/token"], tuned["first loss/token"], rel_tol=1e-2)

    ratio = result["ratio"]
    fastest = min((stock, tuned), key=lambda r: r["ms/batch"])
    assert ratio["step_variant"] == fastest["variant"]
    assert math.isclose(ratio["samples_per_s"], loader["samples/s"] / fastest["samples/s"])
    assert isinstance(ratio["keeps_gpu_fed"], bool)
