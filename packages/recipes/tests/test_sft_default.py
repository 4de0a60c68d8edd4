"""`train-recipes sft` with no config: the embedded default must show a real accuracy gain."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import CLI, assert_quiet


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_embedded_default_learns_addition(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(
        [*CLI, "sft", "--output-dir", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert_quiet(done.stdout + done.stderr)  # the output the README shows
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    # 200 held-out questions never seen in training; a random-init model gets ~0.
    assert before < 0.05, summary
    assert after > before + 0.5, summary
    assert summary["last_loss"] < 0.25 * summary["first_loss"], summary
    assert "exact match" in done.stdout
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "run" / "hf_model" / "model.safetensors").is_file()
