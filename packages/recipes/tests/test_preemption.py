"""Preemption: the signal trap, the launcher's forwarding and verdict, the loop's stop, and a
signal that reaches one of two ranks.

The end-to-end run (SIGTERM to the launcher of 2 ranks, then the exact --resume) is
test_run_safety.py's.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from _preemption_workers import stop_by_a_signal_to_rank0
from conftest import QUIET_CPU_RUN, data_overrides
from train_recipes.data.demo import DemoSplit
from train_recipes.loop.drive import drive
from train_recipes.loop.records import LoopPlan, RunEnd, RunStart, StepRecord
from train_recipes.run import preemption
from train_recipes.run.preemption import LauncherSignals, RunStopped, SignalTrap


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The statuses ``os._exit`` was called with (recorded; this process goes on)."""
    codes: list[int] = []
    monkeypatch.setattr(preemption.os, "_exit", codes.append)
    return codes


def _deliver(signum: int) -> None:
    """Run the handler installed for ``signum`` as the interpreter would on its arrival (a real
    SIGTERM would end this test process if the trap were not there)."""
    handler = signal.getsignal(signum)
    assert callable(handler), handler
    handler(signum, None)


def test_first_signal_is_recorded_and_a_second_ends_at_once(
    exits: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = signal.getsignal(signal.SIGINT)
    with SignalTrap(output_dir=tmp_path, checkpoint=True, grace_s=None, say=True) as trap:
        _deliver(signal.SIGINT)
        assert trap.received == signal.SIGINT and exits == []
        _deliver(signal.SIGTERM)
        assert exits == [143]
    assert signal.getsignal(signal.SIGINT) is before  # restored
    err = capsys.readouterr().err
    assert "stopped at once by SIGTERM (a second SIGTERM); no checkpoint yet; continue with " in err


def test_grace_period_and_checkpoint_off_end_at_once(
    exits: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with SignalTrap(output_dir=tmp_path, checkpoint=True, grace_s=0.2, say=False) as trap:
        _deliver(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trap.received == signal.SIGTERM and exits == [143]
    with SignalTrap(output_dir=tmp_path, checkpoint=False, grace_s=None, say=True):
        _deliver(signal.SIGINT)
    assert exits == [143, 130]
    assert "(train.checkpoint_on_signal=false)" in capsys.readouterr().err


def test_launcher_verdict_from_the_ranks_exit_codes(tmp_path: Path) -> None:
    signals = LauncherSignals(output_dir=tmp_path, checkpoint=True, grace_s=60)
    assert signals.outcome(None) == (0, None) and signals.outcome([1, 1]) == (1, None)
    signals.state.received = signal.SIGTERM
    assert signals.outcome([143, 143]) == (143, None)  # rank 0 printed the line
    assert signals.outcome(None) == (0, None)  # the signal came after the last step
    code, line = signals.outcome([-15, -15])  # killed before their trap existed
    assert code == 143 and line is not None and "the ranks were still starting" in line
    signals.state.at_once = "a second SIGTERM"
    assert signals.outcome([-9, -9]) == (
        143,
        "stopped at once by SIGTERM (a second SIGTERM); no checkpoint yet; continue with --resume",
    )


class _Stages:
    """Records what the loop calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def setup(self) -> RunStart:
        raise AssertionError("drive() does not call setup")

    def train_step(self, step: int) -> StepRecord:
        self.calls.append(("train", step))
        return StepRecord(step=step)

    def evaluate(self, step: int) -> StepRecord:
        self.calls.append(("evaluate", step))
        return StepRecord(step=step)

    def checkpoint(self, step: int) -> None:
        self.calls.append(("checkpoint", step))

    def finish(self) -> RunEnd:
        self.calls.append(("finish", 0))
        return RunEnd(record=StepRecord(step=0), summary={})


def _drive(tmp_path: Path, start_step: int, stop_at: int) -> tuple[Any, list[tuple[str, int]]]:
    plan = LoopPlan(total_steps=6, log_every=1, eval_every=2, checkpoint_every=4)
    start = RunStart(output_dir=tmp_path, plan=plan, start_step=start_step, tensorboard=False)
    stages = _Stages()
    votes: list[int] = []

    def vote(step: int) -> int | None:
        votes.append(step)
        return signal.SIGTERM if step == stop_at else None

    outcome = drive(stages, start, is_main=False, format_summary=lambda *_: "", stop_vote=vote)
    return outcome, stages.calls + [("vote", v) for v in votes]


def test_drive_stops_at_the_agreed_boundary_with_a_checkpoint(tmp_path: Path) -> None:
    outcome, calls = _drive(tmp_path, start_step=0, stop_at=3)
    assert outcome.end is None and outcome.stopped is not None
    assert (outcome.stopped.step, outcome.stopped.signum, outcome.stopped.saved) == (3, 15, True)
    # Step 3's evaluation is not due; the checkpoint is, at once; nothing after it.
    assert calls == [
        ("evaluate", 0),
        ("train", 1),
        ("train", 2),
        ("evaluate", 2),
        ("train", 3),
        ("checkpoint", 3),
        ("vote", 0),
        ("vote", 1),
        ("vote", 2),
        ("vote", 3),
    ]
    # Before the first step (a resumed run): nothing trained, nothing saved again.
    outcome, calls = _drive(tmp_path, start_step=4, stop_at=4)
    assert outcome.stopped is not None and not outcome.stopped.saved
    assert calls == [("vote", 4)]
    # No vote after the last step: the run finishes.
    outcome, calls = _drive(tmp_path, start_step=4, stop_at=6)
    assert outcome.stopped is None and ("finish", 0) in calls
    assert [c for c in calls if c[0] == "vote"] == [("vote", 4), ("vote", 5)]


def test_ctrl_c_outside_the_training_loop_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while the command starts (imports, checks) or ends: no traceback, exit 130."""
    from train_recipes.cli import main as cli

    def interrupted(*_: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "train", interrupted)
    assert cli.main(["sft"]) == 130
    assert capsys.readouterr().err.strip() == (
        "train-recipes sft: stopped by SIGINT outside the training loop; continue with --resume"
    )


def test_stop_line_names_the_checkpoint() -> None:
    saved = RunStopped(step=4, signum=signal.SIGTERM, checkpoint="step_000004", saved=True)
    assert (
        str(saved) == "stopped at step 4 by SIGTERM; checkpoint step_000004; continue with --resume"
    )
    assert saved.exit_code == 143
    early = RunStopped(step=0, signum=signal.SIGINT, checkpoint=None, saved=False)
    assert early.exit_code == 130 and "before the first step" in str(early)


# A launcher that holds two stand-in ranks which note a forwarded SIGINT and never stop.
_LAUNCHER = """
import subprocess, sys
from pathlib import Path
from train_recipes.run import preemption
preemption._LAUNCHER_MARGIN_S = 0.0
preemption._last_checkpoint = lambda _output_dir: "last checkpoint step_000003"
rank = (
    "import pathlib, signal, sys, time\\n"
    "signal.signal(signal.SIGINT, lambda *_: pathlib.Path(sys.argv[1] + '.got').touch())\\n"
    "signal.signal(signal.SIGTERM, lambda *_: pathlib.Path(sys.argv[1] + '.got').touch())\\n"
    "pathlib.Path(sys.argv[1]).touch()\\n"
    "time.sleep(300)\\n"
)
signals = preemption.LauncherSignals(
    output_dir=Path("."), checkpoint=True, grace_s=float(sys.argv[2])
)
with signals.installed():
    ranks = [subprocess.Popen([sys.executable, "-c", rank, f"{sys.argv[1]}/rank{r}"]) for r in (0, 1)]
    codes = [r.wait() for r in ranks]
print(codes, *signals.outcome(codes), sep="\\n")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher reads /proc")
@pytest.mark.parametrize("ending", ["second signal", "grace period"])
def test_launcher_forwards_the_first_signal_to_each_rank_and_stops_them_at_once(
    ending: str, tmp_path: Path
) -> None:
    """The first signal reaches each rank's process (not the launcher's agent); a second one,
    or the grace period passing, SIGKILLs the ranks; the launcher says so in one line."""
    grace = "300" if ending == "second signal" else "1"
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(tmp_path), grace],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ranks = [tmp_path / "rank0", tmp_path / "rank1"]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ranks):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    while not all(r.with_suffix(".got").exists() for r in ranks):
        assert time.monotonic() < deadline, "the signal was not forwarded to every rank"
        time.sleep(0.05)
    if ending == "second signal":
        time.sleep(0.5)
        assert launcher.poll() is None  # waiting for the ranks' checkpoint
        launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0 and "Traceback" not in err, err
    why = "a second SIGINT" if ending == "second signal" else "no checkpoint within "
    codes, status, line = out.splitlines()
    assert (codes, status) == ("[-9, -9]", "130"), out
    assert line.startswith(f"stopped at once by SIGINT ({why}") and line.endswith(
        "); last checkpoint step_000003; continue with --resume"
    ), line


@pytest.mark.timeout(600)
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(
    rank_pool: object, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """SIGINT reaches rank 0 only (as when one host's processes are signalled first): the ranks
    agree at the next step boundary, save that step and raise RunStopped (exit 130) on both."""
    from train_recipes.run.checkpoint_folder import complete_checkpoints

    out = tmp_path / "run"
    overrides = [
        *data_overrides(demo_data),
        f"train.output_dir={out}",
        *QUIET_CPU_RUN,
        "train.steps=40",
        "train.export=false",
        "data.micro_batch_size=8",
        "model.tiny.hidden_size=32",
    ]
    rank0, rank1 = rank_pool.run(  # type: ignore[attr-defined]
        2, stop_by_a_signal_to_rank0, overrides, int(signal.SIGINT), 2, timeout_s=500
    )
    assert rank0["received"] == signal.SIGINT and rank1["received"] is None
    step = rank0["step"]
    assert 2 <= step < 40
    assert {k: v for k, v in rank0.items() if k != "received"} == {
        "step": step,
        "signum": signal.SIGINT,
        "checkpoint": f"step_{step:06d}",
        "exit_code": 130,
        "message": f"stopped at step {step} by SIGINT; checkpoint step_{step:06d}; "
        "continue with --resume",
    }
    assert {k: v for k, v in rank1.items() if k != "received"} == {
        k: v for k, v in rank0.items() if k != "received"
    }
    assert [p.name for p in complete_checkpoints(out)] == [f"step_{step:06d}"]
