"""The benchmark script keeps working (tiny sizes); it is never used for timing claims here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from train_testing.bench.quick import run_quick

BENCH = Path(__file__).parents[1] / "bench" / "log_probs.py"


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The report's rows by variant."""
    return {row["variant"]: row for row in report["rows"]}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_quick_runs_and_writes_json(tmp_path: Path) -> None:
    result = run_quick(BENCH, tmp_path, "--device", "cpu", timeout_s=170)
    assert "x floor" in result.stdout
    report = result.report
    rows = _rows(report)
    ours = [
        "naive",
        "ours",
        "ours_in_place",
        "naive_linear",
        "fused_linear",
        "fused_linear_all",
        "grads_in_forward",
    ]
    peers = ["liger_ce", "liger_fused_linear", "cce", "cce_exact"]
    variants = ["grads_in_forward_fast", "grads_in_forward_exact"]
    assert list(rows) == [*ours[:3], "liger_ce", *ours[3:], *variants, *peers[1:]]
    assert report["floor_ms"] > 0 and report["device"] == "cpu"
    floors = report["rounding_floor_rel_err"]
    for name in [*ours, *variants]:
        row = rows[name]
        assert row["status"] == "ok" and row["median_ms"] > 0 and row["speedup"] > 0
        assert row["peak_extra_gib"] is None  # memory is reported on CUDA only
        # Every one of ours is checked against the fp32 reference; bf16 gradients cannot beat
        # the reference's own rounding to bf16, and ours stay within a few times of it.
        floor = floors["linear" if "linear" in name or "forward" in name else "logits"]
        assert floor * 0.99 <= row["grad_rel_err"] <= 4 * floor, (name, row, floor)
        assert row["loss_rel_err"] < 1e-3, (name, row)
    for name in peers:  # the peers need CUDA (or are not installed): a row says which
        assert rows[name]["status"] in ("needs CUDA", "not installed"), rows[name]
        assert rows[name]["median_ms"] is None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_policy_loss_bench_quick_runs_and_checks_each_form(tmp_path: Path) -> None:
    result = run_quick(BENCH.parent / "policy_loss.py", tmp_path, "--device", "cpu", timeout_s=170)
    report = result.report
    rows = _rows(report)
    ours = [
        "naive",
        "fused_policy",
        "fused_policy_lean",
        "fused_policy_all",
        "fused_policy_entropy",
        "recompute",
    ]
    assert list(rows) == [*ours, "liger_grpo"]
    assert 0 < report["trained_tokens"] < report["tokens"]  # padding is left out
    floor = report["rounding_floor_rel_err"]
    for name in ours:
        row = rows[name]
        assert row["status"] == "ok" and row["median_ms"] > 0, row
        # Checked against the fp32 reference: bf16 gradients within a few times their floor.
        assert floor * 0.99 <= row["grad_rel_err"] <= 4 * floor, (name, row, floor)
        assert row["loss_rel_err"] < 1e-2, (name, row)
    assert rows["liger_grpo"]["status"] in ("needs CUDA", "not installed")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_only_and_ignore_every(tmp_path: Path) -> None:
    """``--only`` keeps the named rows and the baselines; ``--ignore-every`` sets the labels."""
    result = run_quick(
        BENCH, tmp_path, "--device", "cpu", "--ignore-every", "2", "--only", "fused_linear_all"
    )
    rows = [row["variant"] for row in result.report["rows"]]
    assert rows == ["naive", "naive_linear", "fused_linear_all"]
    assert result.report["ignore_every"] == 2
    import subprocess
    import sys

    bad = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--device", "cpu", "--only", "fused_lin"],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert bad.returncode != 0 and "--only: no variant fused_lin" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_autocast_rows_get_unrounded_fp32_gradients(tmp_path: Path) -> None:
    """``--autocast``: fp32 leaves under bf16 autocast. The fused forms hand back fp32
    gradients never rounded to bf16, so they land below the bf16 rounding floor that the
    naive form (autocast's own casts round its gradients) cannot beat."""
    only = "grads_in_forward,grads_in_forward_exact,fused_linear"
    result = run_quick(BENCH, tmp_path, "--device", "cpu", "--autocast", "--only", only)
    report = result.report
    assert report["autocast"] is True
    rows = _rows(report)
    floor = report["rounding_floor_rel_err"]["linear"]
    assert rows["naive_linear"]["grad_rel_err"] >= 0.99 * floor, (rows["naive_linear"], floor)
    for name in only.split(","):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["grad_rel_err"] < 0.8 * floor, (name, rows[name], floor)
        assert rows[name]["loss_rel_err"] < 1e-3, (name, rows[name])


@pytest.mark.slow
@pytest.mark.parametrize("script", ["loss_grad_configs.py", "steady_state.py", "quack_gemms.py"])
def test_cuda_only_benches_say_so_on_the_cpu(script: str) -> None:
    """The GPU-only benches stop with a one-line message naming what they need, not a trace."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, str(BENCH.parent / script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode != 0
    assert "run it on a GPU machine" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
