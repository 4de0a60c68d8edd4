"""LoRA through peft: only adapters train; merged and adapter-only exports reproduce logits."""

from __future__ import annotations

from pathlib import Path

import pytest

from _recipes_workers import run_lora_on_rank
from conftest import check_lora_run, merged_lora_run
from train_recipes.data.demo import DemoSplit

pytest.importorskip("peft", reason="needs the lora extra (peft)")

PROBE = [[3, 23, 24, 17, 25, 35, 5, 4]]


@pytest.mark.timeout(300)
def test_lora_trains_adapters_and_exports(
    rank_pool: object, demo_data: DemoSplit, tmp_path: Path
) -> None:
    run = rank_pool.run(  # type: ignore[attr-defined]
        2,
        run_lora_on_rank,
        merged_lora_run(demo_data, tmp_path / "lora", 20).but("lora.r=8").overrides(),
        PROBE,
        str(tmp_path / "adapter"),
        timeout_s=240,
    )[0]
    # The adapter-only export is checked on the seeded base rebuilt from the default config
    # (the base weights are unchanged under LoRA, as check_lora_run asserts first).
    check_lora_run(run, tmp_path / "adapter", PROBE, window=5)
