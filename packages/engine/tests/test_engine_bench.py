"""The benchmark scripts keep working (`--quick`, tiny sizes, in a subprocess)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from train_testing import requires_module
from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench"


def _run(script: str, tmp_path: Path, *extra: str) -> dict[str, Any]:
    result = run_quick(BENCH / script, tmp_path, "--device", "cpu", *extra).report
    assert result["rows"], result
    return result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overhead_bench_quick(tmp_path: Path) -> None:
    rows = _run("overhead.py", tmp_path)["rows"]
    assert {r["variant"] for r in rows} >= {"hand-written loop", "Engine (nonfinite='step')"}
    assert all(r["median ms/step"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_clip_bench_quick(tmp_path: Path) -> None:
    rows = _run("clip.py", tmp_path)["rows"]
    assert len(rows) == 4 and all(r["median ms"] > 0 for r in rows)


@pytest.mark.slow
@requires_module("transformers", extra="test")
@pytest.mark.timeout(300)
def test_sft_bench_quick(tmp_path: Path) -> None:
    result = _run("sft_llama.py", tmp_path, "--baseline")
    assert [r["tokens/s"] > 0 for r in result["rows"]] == [True, True]
    assert result["meta"]["reference"]["tokens_per_s"] == 45.0e3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_master_adamw_bench_quick(tmp_path: Path) -> None:
    result = _run("master_adamw.py", tmp_path)
    assert len(result["rows"]) == 3 and all(r["median ms"] > 0 for r in result["rows"])
    # Same fp32 arithmetic as AdamW on fp32 parameters (no clipping divisor on the CPU).
    assert result["meta"]["master err vs fp32 params"]["master"] < 1e-6
