"""The 8B FSDP2 + activation-checkpointing benchmark keeps working (`--quick`: tiny models on
the CPU, subprocess): one checkpointed step variant and the load comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "dense_8b.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dense_8b_quick(tmp_path: Path) -> None:
    options = ["--variants", "1.5b+ac,load", "--load-dir", str(tmp_path / "ckpt")]
    rows = run_quick(BENCH, tmp_path, *options, timeout_s=280).report["rows"]
    assert [r["variant"] for r in rows] == ["1.5b+ac", "load:from_pretrained", "load:sharded_load"]
    assert rows[0]["activation_checkpointing"] and rows[0]["tokens_per_s"] > 0
    assert all(r["seconds"] > 0 for r in rows[1:])
    assert (tmp_path / "ckpt" / "config.json").is_file()  # a given --load-dir is kept
