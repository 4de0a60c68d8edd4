"""The packed-step benchmark keeps working (`--quick`: tiny model, CPU, subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "packed_step.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("long", [False, True])
def test_packed_step_quick(tmp_path: Path, long: bool) -> None:
    result = run_quick(BENCH, tmp_path, *(["--long"] if long else []), timeout_s=280).report
    names = [r["variant"] for r in result["rows"]]
    expected = (
        ["packed", "varlen-direct"]
        if long
        else ["packed", "unpacked", "dense-mask", "varlen-direct"]
    )
    assert names == expected
    assert result["meta"]["checkpoint"] is long
    assert {"torch", "transformers", "device_name"} <= set(result["meta"])
    rows = {r["variant"]: r for r in result["rows"]}
    for row in rows.values():
        assert row["tokens/s"] > 0 and row["vs varlen-direct"] > 0, row
    # Same documents, same trained tokens: every per-document path gives the same loss
    # (fp32 on the CPU); the unpacked rows attend across documents and differ.
    ref = rows["varlen-direct"]["first loss"]
    for name in ("packed", "dense-mask"):
        if name in rows:
            assert rows[name]["first loss"] == pytest.approx(ref, rel=1e-5), (name, rows)
    if not long:
        assert rows["unpacked"]["first loss"] != pytest.approx(ref, rel=1e-5)
