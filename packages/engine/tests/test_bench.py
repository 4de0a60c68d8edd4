"""The benchmark scripts keep working (`--quick`, tiny sizes, in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from train_testing import requires_module

BENCH = Path(__file__).parents[1] / "bench"


def _run(script: str, tmp_path: Path, *extra: str) -> dict:
    if not (BENCH / script).is_file():
        pytest.skip(f"bench folder not shipped here ({BENCH}); the scripts live in the repository")
    out = tmp_path / f"{script}.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / script),
            "--quick",
            "--device",
            "cpu",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["rows"], result
    return result


@pytest.mark.timeout(300)
def test_overhead_bench_quick(tmp_path: Path) -> None:
    rows = _run("overhead.py", tmp_path)["rows"]
    assert {r["variant"] for r in rows} >= {"hand-written loop", "Engine (nonfinite='step')"}
    assert all(r["median ms/step"] > 0 for r in rows)


@pytest.mark.timeout(300)
def test_clip_bench_quick(tmp_path: Path) -> None:
    rows = _run("clip.py", tmp_path)["rows"]
    assert len(rows) == 4 and all(r["median ms"] > 0 for r in rows)


@requires_module("transformers", extra="test")
@pytest.mark.timeout(300)
def test_sft_bench_quick(tmp_path: Path) -> None:
    result = _run("sft_llama.py", tmp_path, "--baseline")
    assert [r["tokens/s"] > 0 for r in result["rows"]] == [True, True]
    assert result["meta"]["reference"]["tokens_per_s"] == 45.0e3
