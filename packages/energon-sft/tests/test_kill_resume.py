"""Kill-and-resume: SIGKILL a process after it saved its loader state; a fresh process resumes
and yields exactly the batches (content digests) of an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _esft_data import build_dataset, chat_rows

SCRIPT = Path(__file__).parent / "_esft_resume_proc.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    ds = build_dataset(tmp_path, chat_rows(40, image_every=2), samples_per_shard=10)
    out = tmp_path / "states"
    out.mkdir()
    victim = subprocess.run(
        [sys.executable, str(SCRIPT), "victim", str(ds), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert victim.returncode == -signal.SIGKILL, victim.stderr[-3000:]
    saved = sorted(p.name for p in out.glob("*.pt"))
    assert len(saved) == 5, saved
    resume = subprocess.run(
        [sys.executable, str(SCRIPT), "resume", str(ds), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resume.returncode == 0, resume.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert sorted(result) == sorted(p[: -len(".pt")] for p in saved)
    for name, r in result.items():
        n = r["n"]
        assert len(set(r["reference"])) == len(r["reference"]), f"{name}: batches must differ"
        assert r["resumed"] == r["reference"][n:], f"{name}: resumed stream differs"
        assert r["resaved"] == r["reference"][n:], f"{name}: state saved after restore differs"
