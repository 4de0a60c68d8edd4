"""The saved-activations benchmark keeps working (`--quick`: tiny layer, CPU, subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "saved_activations.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_saved_activations_quick(tmp_path: Path) -> None:
    variants = "eager,compiled,budget=0.9,budget=0"
    options = ["--device", "cpu", "--variants", variants, "--list"]
    rows = run_quick(BENCH, tmp_path, *options, timeout_s=280).report["rows"]
    assert [r["variant"] for r in rows] == variants.split(",")
    by_name = {r["variant"]: r for r in rows}
    # The hooks saw what the compiled functions hold (the script asserts the counts match).
    assert not by_name["eager"]["compiled node"]
    assert all(by_name[v]["compiled node"] for v in ("compiled", "budget=0.9", "budget=0"))
    saved = [by_name[v]["activation bytes/token"] for v in variants.split(",")]
    assert saved == sorted(saved, reverse=True) and len(set(saved)) == 4, saved
    # Full recomputation keeps the layer's input only.
    names = [s["name"] for s in by_name["budget=0"]["saved"] if s["kind"] == "activation"]
    assert names == ["layer input"], names
    # Every saved activation was recognised as one of the eager layer's intermediates.
    for r in rows:
        unknown = [s for s in r["saved"] if s["kind"] == "activation" and s["name"] == "?"]
        assert not unknown, (r["variant"], unknown)
