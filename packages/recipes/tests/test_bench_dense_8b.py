"""The 8B FSDP2 + activation-checkpointing benchmark keeps working (`--quick`: tiny models on
the CPU, subprocess): one checkpointed step variant and the load comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "dense_8b.py"


@pytest.mark.timeout(300)
def test_dense_8b_quick(tmp_path: Path) -> None:
    out = tmp_path / "dense_8b.json"
    command = [sys.executable, str(BENCH), "--quick", "--variants", "1.5b+ac,load"]
    proc = subprocess.run(
        [*command, "--load-dir", str(tmp_path / "ckpt"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["1.5b+ac", "load:from_pretrained", "load:sharded_load"]
    assert rows[0]["activation_checkpointing"] and rows[0]["tokens_per_s"] > 0
    assert all(r["seconds"] > 0 for r in rows[1:])
    assert (tmp_path / "ckpt" / "config.json").is_file()  # a given --load-dir is kept
