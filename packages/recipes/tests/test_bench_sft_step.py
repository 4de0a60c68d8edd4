"""The end-to-end SFT step benchmark keeps working (`--quick`: tiny model, CPU, subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "sft_step.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sft_step_quick(tmp_path: Path) -> None:
    variants = (
        "fsdp2,fsdp2+compile,recipes,recipes-logits-loss,recipes-hf-mask,recipes-cp1,recipes-lean,"
        "recipes-master,amp+vp"
    )
    options = ["--variants", variants, "--sdpa", "flash,math", "--profile", "recipes"]
    result = run_quick(BENCH, tmp_path, *options, timeout_s=280).report
    assert [r["variant"] for r in result["rows"]] == variants.split(",")
    for row in result["rows"]:
        assert row["tokens/s"] > 0 and row["vs fsdp2+compile"] > 0, row
        # Every variant's first loss and gradients against the fp32 reference (fp32 on the
        # CPU: only summation order differs).
        assert row["loss rel err"] < 1e-5, row
        assert row["grad rel err"] < 1e-4, row
    assert "aten::" in (tmp_path / "profile_recipes.txt").read_text()
