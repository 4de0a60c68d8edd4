"""train_testing.bench: table layout, JSON output, timing turns, board samples, and the --quick
runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from train_testing.bench import (
    LLAMA_1P5B,
    alternating_medians,
    board_samples,
    event_median_ms,
    event_ms,
    flops_per_token,
    fmt,
    format_table,
    llama_dims,
    print_table,
    versions,
    write_json,
)
from train_testing.bench.board import summarise
from train_testing.bench.quick import run_quick


def test_fmt_writes_floats_to_four_digits_and_none_as_asked() -> None:
    assert fmt(3.14159265) == "3.142"
    assert fmt(1234567.0) == "1.235e+06"
    assert fmt(None) == "" and fmt(None, none="None") == "None"
    assert fmt(7) == "7" and fmt("x") == "x"


def test_format_table_aligns_columns_to_the_widest_cell() -> None:
    rows = [{"variant": "a", "ms": 1.5}, {"variant": "longer name", "ms": 12.25, "extra": 1}]
    lines = format_table(rows, ["variant", "ms", "missing"])
    assert lines == [
        "variant      ms     missing",
        "a            1.5           ",
        "longer name  12.25         ",
    ]
    # No rows: the header alone (max() over an empty row list must not fail).
    assert format_table([], ["a", "bb"]) == ["a  bb"]


def test_format_table_takes_another_cell_writer() -> None:
    lines = format_table([{"ok": True}], ["ok"], cell=lambda v: "yes" if v else "NO")
    assert lines == ["ok ", "yes"]


def test_print_table_puts_a_blank_line_and_the_title_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    print_table([{"a": 1}], ["a"], title="Title")
    assert capsys.readouterr().out == "\nTitle\na\n1\n"


def test_write_json_creates_the_folder_and_stringifies_what_json_cannot_hold(
    tmp_path: Path,
) -> None:
    path = write_json(tmp_path / "deep" / "out.json", {"p": tmp_path, "n": [1, 2]})
    assert json.loads(path.read_text()) == {"p": str(tmp_path), "n": [1, 2]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.json"]  # no .tmp left


def test_alternating_medians_warms_up_then_takes_turns() -> None:
    calls: list[str] = []
    variants = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    values = {"a": iter([3.0, 1.0, 2.0]), "b": iter([10.0, 30.0, 20.0])}

    def measure(fn: object) -> float:
        fn()  # type: ignore[operator]
        return next(values[calls[-1]])

    medians = alternating_medians(variants, repeats=3, measure=measure)
    assert medians == {"a": 2.0, "b": 20.0}
    assert calls == ["a", "b"] + ["a", "b"] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_event_timers_order_device_work_by_its_length() -> None:
    """A kernel that spins 10x longer on the device times longer, though the host returns from
    launching either at once (the timers read device time, not host time)."""
    cycles = 2_000_000
    short = event_median_ms(lambda: torch.cuda._sleep(cycles), warmup=1, repeats=5)
    long = event_median_ms(lambda: torch.cuda._sleep(10 * cycles), warmup=1, repeats=5)
    assert 0 < short < long
    assert 5 * short < long < 20 * short
    one = event_ms(lambda: torch.cuda._sleep(10 * cycles))
    assert 0.5 * long < one < 2 * long


def test_llama_dims_are_fresh_copies_of_the_1p5b_config() -> None:
    dims = llama_dims(quick=False)
    dims["hidden_size"] = 1
    assert LLAMA_1P5B["hidden_size"] == 2048
    assert llama_dims(quick=True)["num_hidden_layers"] == 2

    class Config:
        num_hidden_layers, hidden_size = 2, 8

    assert flops_per_token(100, Config(), 16) == 6.0 * 100 + 6.0 * 2 * 8 * 16


def test_versions_names_missing_distributions() -> None:
    out = versions("surely-not-a-distribution-xyz")
    assert out["surely-not-a-distribution-xyz"] == "not installed"
    assert out["torch"] and out["python"]


def test_importing_the_helpers_does_not_import_pytest() -> None:
    code = "import sys, train_testing.bench; sys.exit(int('pytest' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake_bench.py"
    script.write_text(textwrap.dedent(body))
    return script


def test_run_quick_passes_quick_and_the_out_flag_and_reads_the_json(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import json, sys
        argv = sys.argv[1:]
        out = argv[argv.index("--json") + 1]
        json.dump({"argv": argv}, open(out, "w"))
        print("table")
        """,
    )
    run = run_quick(script, tmp_path, "--device", "cpu", out_flag="--json", timeout_s=60)
    assert run.report["argv"] == ["--quick", "--device", "cpu", "--json", str(run.out)]
    assert run.stdout == "table\n"


def test_run_quick_fails_with_the_scripts_output(tmp_path: Path) -> None:
    script = _script(tmp_path, "import sys; print('partial'); sys.exit('broken: reason')")
    with pytest.raises(AssertionError, match=r"(?s)exited with 1.*partial.*broken: reason"):
        run_quick(script, tmp_path, timeout_s=60)


def test_run_quick_skips_when_the_script_is_not_shipped(tmp_path: Path) -> None:
    with pytest.raises(pytest.skip.Exception, match="not shipped here"):
        run_quick(tmp_path / "absent.py", tmp_path)


def _fake_smi(directory: Path, lines: list[str]) -> None:
    """An ``nvidia-smi`` on PATH that prints ``lines`` (then sleeps) each sampling period."""
    body = "".join(f"echo '{line}'\n" for line in lines)
    script = directory / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nwhile true; do\n{body}sleep 0.05\ndone\n")
    script.chmod(0o755)


def test_board_samples_summarise_power_and_clock(tmp_path: Path, monkeypatch) -> None:
    _fake_smi(
        tmp_path,
        ["690.5, 1470, 700.00, 1980", "[N/A], 1500, 700.00, 1980", "699.5, 1530, 700.00, 1980"],
    )
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    report: dict[str, object] = {}
    with board_samples(report, gpu="0", period_ms=50):
        time.sleep(0.5)
    assert isinstance(report["samples"], int) and report["samples"] >= 2
    # the [N/A] line is dropped; the other two alternate
    assert report["power_w_range"] == [690.5, 699.5]
    assert report["sm_mhz_range"] == [1470.0, 1530.0]
    assert 690.5 <= report["power_w_median"] <= 699.5
    assert report["power_limit_w"] == 700.0 and report["sm_mhz_max"] == 1980.0


def test_board_samples_without_nvidia_smi_note_it_and_run_the_block(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    report: dict[str, object] = {}
    ran = []
    with board_samples(report):
        ran.append(True)
    assert ran == [True]
    assert report == {"note": "nvidia-smi not found: no power or clock samples"}


def test_board_samples_stop_the_sampler_when_the_block_raises(tmp_path: Path, monkeypatch) -> None:
    _fake_smi(tmp_path, ["650, 1600, 700, 1980"])
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    report: dict[str, object] = {}

    def failing_block() -> None:
        with board_samples(report, gpu="0", period_ms=50):
            time.sleep(0.3)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        failing_block()
    assert report["sm_mhz_median"] == 1600.0


def test_board_summary_of_unreadable_output() -> None:
    assert summarise("[N/A], [N/A], [N/A], [N/A]\n1, 2\n") == {
        "note": "nvidia-smi gave no readable samples"
    }


def test_board_samples_keep_sampling_past_a_pipe_buffer(tmp_path: Path, monkeypatch) -> None:
    # A sampler that writes fast: more than a pipe's 64 KiB (about 2400 lines) within the
    # block. Samples read only at the end must still all arrive (nothing blocks the sampler).
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\nwhile true; do echo '690.5, 1470, 700.00, 1980'; done\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    report: dict[str, object] = {}
    with board_samples(report, gpu="0"):
        time.sleep(0.5)
    assert isinstance(report["samples"], int) and report["samples"] > 5000
