"""Run safety through the real CLI on tiny runs: the final step is saved, used folders are
refused, a folder has one live job, ranks die with their launcher, config changes on resume are
applied or refused, resume across dp sizes, and SIGKILL at any point then --resume is exact."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml

from _recipes_workers import metric_rows
from _runs import TinyRun, assert_same_weights, exported_weights
from conftest import CLI, cli_env
from train_recipes.data.demo import DemoSplit


def _tiny(split: DemoSplit, out: Path, *extra: str, **fields: object) -> TinyRun:
    """7 steps of a hidden-32 model (the import of torch and transformers is most of a run's
    time), checkpoints at step 5 and the end, no export; ``fields`` and ``extra`` change it."""
    run = TinyRun(
        data=split,
        out=out,
        steps=7,
        checkpoint_every=5,
        keep_checkpoints=3,
        export=False,
        micro_batch_size=8,
        hidden_size=32,
    )
    return run.but(*extra, **fields)


def _cmd(
    split: DemoSplit,
    out: Path,
    *extra: str,
    nproc: int = 1,
    flags: tuple[str, ...] = (),
    **fields: object,
) -> list[str]:
    """The arguments of ``train-recipes sft`` on the tiny run."""
    return _tiny(split, out, *extra, **fields).cli_args(nproc=nproc, flags=flags)


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The CLI in a fresh process."""
    return subprocess.run(
        [*CLI, *args], env=cli_env(), capture_output=True, text=True, timeout=timeout
    )


def _main(capsys: pytest.CaptureFixture[str], args: list[str]) -> subprocess.CompletedProcess[str]:
    """The CLI's entry point in this process: for refusals and checks that start no rank
    (saves a process start; one test per check runs it as a real process too)."""
    from train_recipes.cli.main import main

    capsys.readouterr()
    code = main(args)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def _ok(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done


def _one_line_error(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, one error line on stderr holding every needle, no traceback, no rank started
    (the preflight's warnings, e.g. a warm-up longer than these tiny runs, are not errors)."""
    lines = [
        line for line in done.stderr.splitlines() if line.strip() and ": warning: " not in line
    ]
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "sft dp=" not in done.stdout + done.stderr, "a rank started"
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _rows(run: Path) -> dict[int, dict[str, float]]:
    rows = metric_rows(run)
    return {r["step"]: r for r in rows if "loss" in r}


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def finished_run(demo_data: DemoSplit, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 7-step run with checkpoint_every=5 and the end-of-run export (the live model)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    _ok(_run(_cmd(demo_data, run, export=True)))
    return run


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns(".lock"))
    return dest


def _flip_a_byte(checkpoint: Path) -> Path:
    """Flip one byte in the middle of the checkpoint's first DCP file; returns the file."""
    distcp = sorted(checkpoint.rglob("*.distcp"))[0]
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0xFF
    distcp.write_bytes(bytes(data))
    return distcp


def _error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The CLI's own error lines (one per failure, from rank 0; not the preflight's warnings),
    after no traceback."""
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    return [
        line
        for line in done.stderr.splitlines()
        if line.startswith("train-recipes sft:") and ": warning: " not in line
    ]


def test_final_step_is_saved_and_export_takes_the_newest_complete(
    finished_run: Path, demo_data: DemoSplit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # checkpoint_every=5 and 7 steps: steps 5 and 7 (the last step is always saved).
    assert _checkpoints(finished_run) == ["step_000005", "step_000007"]
    run = _copy(finished_run, tmp_path / "run")
    # An interrupted later save and a folder without its completion marker: never taken.
    (run / "checkpoints" / "step_000009.tmp").mkdir()
    (run / "checkpoints" / "step_000008").mkdir()
    shutil.rmtree(run / "hf_model")  # as with train.export=false: only checkpoints remain
    out = tmp_path / "exported"
    done = _ok(_run(["export", str(run), "--out", str(out)]))
    assert str(out) in done.stdout
    # The final checkpoint holds the final weights: equal to the live model's export.
    assert_same_weights(out, finished_run / "hf_model")

    # A corrupt newest checkpoint is named and skipped for the previous one (step 5).
    distcp = _flip_a_byte(run / "checkpoints" / "step_000007")
    out5 = tmp_path / "exported-5"
    fallback = _ok(_run(["export", str(run), "--out", str(out5)]))
    assert distcp.name in fallback.stderr and "falling back" in fallback.stderr, fallback.stderr
    final, step5 = exported_weights(finished_run / "hf_model"), exported_weights(out5)
    assert final.keys() == step5.keys() and any(not torch.equal(final[k], step5[k]) for k in final)

    # Resuming a finished run says so and exits 0 without replaying anything.
    metrics = (run / "metrics.jsonl").read_bytes()
    again = _ok(_main(capsys, _cmd(demo_data, run, flags=("--resume",))))
    assert "finished at step 7" in again.stdout, again.stdout
    assert "sft dp=" not in again.stdout + again.stderr
    assert (run / "metrics.jsonl").read_bytes() == metrics

    # A run folder without a complete checkpoint: a one-line error.
    empty = tmp_path / "killed-early"
    (empty / "checkpoints" / "step_000002.tmp").mkdir(parents=True)
    shutil.copy(run / "config.yaml", empty / "config.yaml")
    shutil.copytree(run / "tokenizer", empty / "tokenizer")
    failed = _main(capsys, ["export", str(empty)])
    assert failed.returncode == 2 and "no complete checkpoint" in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr


def test_resume_sets_damaged_checkpoints_aside_and_keeps_a_changed_schedule_continuous(
    finished_run: Path, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """Issue 43 items 1 and 8: the newest checkpoint fails its checksum, so the resume names
    it, moves it to checkpoints/damaged/ (kept, never deleted, ignored by pruning) and goes on
    from step 5; the longer run with a 2-step warm-up continues the learning rate from the
    saved one, straight down to the schedule's end value (linear), where the new schedule
    alone would have jumped 3.2x."""
    run = _copy(finished_run, tmp_path / "run")
    _flip_a_byte(run / "checkpoints" / "step_000007")
    done = _ok(_run(_cmd(demo_data, run, flags=("--resume",), steps=10, warmup_steps=2)))
    assert "step_000007 did not load" in done.stdout and "falling back" in done.stdout
    assert "to " + str(run / "checkpoints" / "damaged") in done.stdout, done.stdout
    assert (run / "checkpoints" / "damaged" / "step_000007" / "COMPLETE").is_file()
    assert "at step 5" in done.stdout and "keeps the learning rate continuous" in done.stdout
    assert _checkpoints(run) == ["damaged", "step_000005", "step_000010"]
    rows = _rows(run)
    assert sorted(rows) == list(range(1, 11))
    lr, saved, end = 3e-3, 6 / 30, 0.05  # warm-up 30 of the old run; min_lr_ratio 0.05
    assert rows[5]["lr"] == pytest.approx(lr * saved, rel=1e-12)  # the rate of step 6
    for step in range(6, 11):
        line = saved + (end - saved) * (step - 5) / 5
        assert rows[step]["lr"] == pytest.approx(lr * line, rel=1e-9), step


def test_resume_refuses_when_no_checkpoint_loads_and_changes_nothing(
    finished_run: Path, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """Issue 43 item 1: one flipped byte in the only checkpoint; the resume exits non-zero with
    one line naming it and keeps every file as it was (it used to delete the checkpoint and
    start over from step 0, exiting 0)."""
    run = _copy(finished_run, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step_000005")
    distcp = _flip_a_byte(run / "checkpoints" / "step_000007")
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    done = _run(_cmd(demo_data, run, flags=("--resume",), steps=9))
    assert done.returncode == 1, (done.stdout[-2000:], done.stderr[-2000:])
    errors = _error_lines(done)
    assert len(errors) == 1 and "no checkpoint in" in errors[0], done.stderr[-2000:]
    assert f"step_000007: {distcp}" in errors[0] and "nothing was changed" in errors[0]
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    changed = [p for p in files if after.get(p) != files[p] and p.parent.name != "tokenizer"]
    assert not changed and set(after) == set(files), (changed, set(after) ^ set(files))


def test_resume_finishes_an_interrupted_end(
    finished_run: Path, demo_data: DemoSplit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 43 item 5: stopped during the final export (only hf_model.tmp, no summary), the
    run is not reported as finished: --resume exports the final checkpoint and writes the
    summary, saying so; after that the run is finished."""
    from train_recipes.run.end_state import EndState, read_end_state, write_end_state

    run = _copy(finished_run, tmp_path / "run")
    assert read_end_state(run) == EndState(
        steps=7, trained=True, final_checkpoint=True, exported=True, summary=True
    )
    (run / "hf_model").rename(run / "hf_model.tmp")
    (run / "summary.json").unlink()
    write_end_state(run, EndState(steps=7, trained=True, final_checkpoint=True))
    done = _ok(_run(_cmd(demo_data, run, flags=("--resume",), export=True)))
    assert "end was interrupted: finishing the export and the summary" in done.stdout
    assert_same_weights(run / "hf_model", finished_run / "hf_model")
    assert not (run / "hf_model.tmp").exists()
    summary = json.loads((run / "summary.json").read_text())
    reference = json.loads((finished_run / "summary.json").read_text())
    for key in ("steps", "first_loss", "last_loss", "skipped_steps"):
        assert summary[key] == reference[key], key
    assert sorted(_rows(run)) == list(range(1, 8))
    assert read_end_state(run) == read_end_state(finished_run)
    again = _ok(_main(capsys, _cmd(demo_data, run, flags=("--resume",), export=True)))
    assert "finished at step 7" in again.stdout


@pytest.mark.slow
def test_used_folder_is_refused_and_overwrite_replaces_only_the_run(
    finished_run: Path, demo_data: DemoSplit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(finished_run, tmp_path / "run")
    fresh = _run(_cmd(demo_data, run))
    _one_line_error(fresh, str(run), "--resume", "--overwrite")
    both = _main(capsys, _cmd(demo_data, run, flags=("--resume", "--overwrite")))
    _one_line_error(both, "--resume", "--overwrite")

    # --overwrite never deletes what is not the run's: refused, nothing removed.
    (run / "notes.txt").write_text("mine")
    foreign = _main(capsys, _cmd(demo_data, run, flags=("--overwrite",)))
    _one_line_error(foreign, "notes.txt", str(run))
    assert (run / "notes.txt").is_file() and _checkpoints(run) == ["step_000005", "step_000007"]
    (run / "notes.txt").unlink()

    # --overwrite: the old run's checkpoints (higher steps) go; pruning sees only this run's.
    _ok(
        _run(
            _cmd(
                demo_data,
                run,
                flags=("--overwrite",),
                steps=4,
                checkpoint_every=2,
                keep_checkpoints=1,
            )
        )
    )
    assert _checkpoints(run) == ["step_000004"]
    assert sorted(_rows(run)) == [1, 2, 3, 4]
    assert not (run / "hf_model").exists()
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 4


@pytest.mark.slow
def test_config_changes_on_resume_are_applied_or_refused(
    finished_run: Path, demo_data: DemoSplit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(finished_run, tmp_path / "run")
    config_before = (run / "config.yaml").read_text()
    refused = _main(
        capsys,
        _cmd(demo_data, run, "train.seed=1", flags=("--resume",), steps=10, micro_batch_size=4),
    )
    _one_line_error(refused, "data.micro_batch_size: 8 -> 4", "train.seed: 0 -> 1")
    assert (run / "config.yaml").read_text() == config_before

    applied = _ok(
        _run(
            _cmd(
                demo_data,
                run,
                "train.peak_tflops=0.5",
                flags=("--resume",),
                steps=10,
                lr=1e-3,
                accumulation=2,
            )
        )
    )
    assert "resume applies optim.lr: 0.003 -> 0.001" in applied.stdout, applied.stdout
    rows = _rows(run)
    assert sorted(rows) == list(range(1, 11))
    # Rates (issue 37): tokens/s per GPU on every record (one rank: the global rate); MFU only
    # against a peak, which a CPU has none of until train.peak_tflops gives one (the resume).
    first = json.loads((finished_run / "summary.json").read_text())
    assert first["tokens_per_s_per_gpu"] > 0
    assert first["mfu"] is first["peak_tflops"] is first["peak_memory_gib"] is None, first
    for step in range(1, 11):
        assert rows[step]["tokens_per_s_per_gpu"] == pytest.approx(rows[step]["tokens_per_s"])
        assert ("mfu" in rows[step]) == (step > 7), rows[step]
        assert "peak_memory_gib" not in rows[step]  # CUDA only
    assert all(0 < rows[s]["mfu"] < 1 for s in range(8, 11)), rows
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["peak_tflops"] == 0.5 and 0 < resumed["mfu"] < 1, resumed
    assert resumed["tokens_per_s_per_gpu"] > 0
    assert re.search(
        r"throughput +[\d,]+ tokens/s per GPU, MFU [\d.]+% of 0.5 TFLOPS", applied.stdout
    )
    # Linear warm-up over 30 steps: the logged rate after step s is lr * (s + 1) / 30, with the
    # new peak from the resume on (the checkpoint's base rate would give 3e-3), and the
    # schedule advances once per optimizer step (not once per micro-batch).
    for step in range(1, 11):
        peak = 3e-3 if step <= 7 else 1e-3
        assert rows[step]["lr"] == pytest.approx(peak * (step + 1) / 30, rel=1e-12), step
    # Two micro-batches per step after the resume: twice the loss tokens.
    before = sum(rows[s]["loss_tokens"] for s in range(1, 8)) / 7
    after = sum(rows[s]["loss_tokens"] for s in range(8, 11)) / 3
    assert 1.7 < after / before < 2.3, (before, after)
    # The records continue across the resume: the window average and the first loss.
    losses = [rows[s]["loss"] for s in range(1, 9)]
    assert rows[8]["loss_avg_window"] == pytest.approx(sum(losses) / 8, rel=1e-12)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["first_loss"] == rows[1]["loss"]
    # config.yaml says what trains now; the history says what changed when.
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["optim"]["lr"] == 1e-3 and config["train"]["gradient_accumulation_steps"] == 2
    history = [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == [7]
    changes = history[0]["changes"]
    assert changes.pop("train.output_dir")[1] == str(run)  # the copied folder
    assert changes == {
        "optim.lr": [0.003, 0.001],
        "train.export": [True, False],
        "train.gradient_accumulation_steps": [1, 2],
        "train.peak_tflops": [None, 0.5],
        "train.steps": [7, 10],
    }


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
@pytest.mark.timeout(300)
def test_ranks_die_with_their_launcher_and_a_live_run_folder_is_locked(
    demo_data: DemoSplit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from train_recipes.run.folder import RunLock

    run = tmp_path / "run"
    launcher = subprocess.Popen(
        [*CLI, *_cmd(demo_data, run, nproc=2, steps=100000, checkpoint_every=0)],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 200
        metrics = run / "metrics.jsonl"
        while time.monotonic() < deadline and launcher.poll() is None:
            if metrics.is_file() and metrics.read_text().count("\n") >= 2:
                break
            time.sleep(0.2)
        assert launcher.poll() is None and metrics.is_file(), "the ranks did not start training"
        ranks = _descendants(launcher.pid)
        assert len(ranks) >= 2, ranks

        # A second job into the live run's folder: one line naming the folder and the holder.
        second = _main(capsys, _cmd(demo_data, run, flags=("--resume",)))
        _one_line_error(second, str(run), f"PID {launcher.pid}")

        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in ranks if _alive(p)], "ranks outlived their launcher"
        RunLock(run).acquire().release()  # the dead job's lock is gone
    finally:
        # The elastic agent starts its ranks in their own process groups: kill them by PID.
        for pid in [launcher.pid, *ranks]:
            with contextlib.suppress(OSError):
                if b"train_recipes" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_on_another_dp_size_continues_the_same_losses(
    rank_pool: object, demo_data: DemoSplit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 ranks x accumulation 1 and 1 rank x accumulation 2 over 2 logical shards take the
    same global batches: a run saved on 2 ranks continues on 1 with the same losses."""
    from _recipes_workers import run_sft_on_rank

    ref = tmp_path / "dp2"
    shape: dict[str, int] = {"steps": 6, "checkpoint_every": 3, "logical_shards": 2}
    rank_pool.run(  # type: ignore[attr-defined]
        2,
        run_sft_on_rank,
        _tiny(demo_data, ref, **shape).overrides(),
        [[3, 4]],
        timeout_s=240,
    )
    ref_rows = _rows(ref)
    run = _copy(ref, tmp_path / "dp1")
    shutil.rmtree(run / "checkpoints" / "step_000006")  # as if killed after step 5

    mismatched = _main(
        capsys, _cmd(demo_data, run, flags=("--resume",), **{**shape, "logical_shards": 4})
    )
    _one_line_error(mismatched, "data.num_logical_shards", "2 logical shards")

    resumed = _ok(_run(_cmd(demo_data, run, flags=("--resume",), accumulation=2, **shape)))
    assert "the same global batch" in resumed.stdout, resumed.stdout
    rows = _rows(run)
    assert sorted(rows) == list(range(1, 7))
    for key in ("loss", "loss_avg_window"):
        got = torch.tensor([rows[s][key] for s in range(4, 7)], dtype=torch.float64)
        want = torch.tensor([ref_rows[s][key] for s in range(4, 7)], dtype=torch.float64)
        torch.testing.assert_close(
            got, want, rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}"
        )


@contextlib.contextmanager
def _running_until(
    cmd: list[str], trigger: Callable[[], bool], log: Path, timeout: float = 200
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``cmd`` (output in ``log``) and yield it the moment ``trigger()`` holds; SIGKILL
    whatever is left of its process group after."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*CLI, *cmd],
            env=cli_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        while not trigger():
            assert proc.poll() is None, f"the run ended before the kill point:\n{log.read_text()}"
            assert time.monotonic() < deadline, "the kill point never came"
            time.sleep(0.001)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _kill_when(
    cmd: list[str], trigger: Callable[[], bool], log: Path, timeout: float = 200
) -> None:
    """Start ``cmd``, freeze it (SIGSTOP) the moment ``trigger()`` holds, then SIGKILL it."""
    with _running_until(cmd, trigger, log, timeout) as proc:
        os.killpg(proc.pid, signal.SIGSTOP)


def _assert_nothing_half_written(run: Path) -> None:
    from train_recipes.run.checkpoint_folder import complete_checkpoints

    root = run / "checkpoints"
    plain = [p for p in root.iterdir() if "." not in p.name] if root.is_dir() else []
    # Every checkpoint a reader can name is complete; the rest are .tmp/.old leftovers.
    complete = {p.name for p in complete_checkpoints(run)}
    newest = max((p.name for p in plain), default=None)
    assert newest is None or newest in complete, (sorted(p.name for p in plain), complete)
    if (run / "config.yaml").exists():
        assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 7
    assert not (run / "hf_model").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_at_any_point_then_resume_is_exact(
    finished_run: Path, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """Killed during the first checkpoint write (none complete: a clean start), during a later
    write, and after a checkpoint; each --resume continues, and the run ends with the
    uninterrupted run's losses, loss windows, summary and final weights, bit for bit."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    cmd = _cmd(demo_data, run, checkpoint_every=2, keep_checkpoints=2)
    resume = [*cmd, "--resume"]

    # 1. Frozen while step 2's save is in flight: its .tmp exists, the final name does not.
    for _ in range(5):
        shutil.rmtree(run, ignore_errors=True)
        _kill_when(cmd, lambda: (ckpts / "step_000002.tmp").is_dir(), tmp_path / "1.log")
        if not (ckpts / "step_000002").exists():
            break
    assert (ckpts / "step_000002.tmp").is_dir() and not (ckpts / "step_000002").exists()
    _assert_nothing_half_written(run)

    # 2. The resume starts clean (nothing complete) and is killed during step 4's save.
    _kill_when(resume, lambda: (ckpts / "step_000004.tmp").is_dir(), tmp_path / "2.log")
    assert "no complete checkpoint" in (tmp_path / "2.log").read_text()
    _assert_nothing_half_written(run)

    # 3. The next resume continues from step 2 (or 4) and is killed right after step 6's save.
    _kill_when(resume, lambda: (ckpts / "step_000006").is_dir(), tmp_path / "3.log")
    assert "resumed from" in (tmp_path / "3.log").read_text()
    _assert_nothing_half_written(run)

    # 4. The last resume finishes the run.
    _ok(_run(resume))
    got, want = _rows(run), _rows(finished_run)
    assert sorted(got) == sorted(want) == list(range(1, 8))
    for step in want:
        for key in ("loss", "loss_avg_window", "lr", "grad_norm"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
    summary = json.loads((run / "summary.json").read_text())
    reference = json.loads((finished_run / "summary.json").read_text())
    assert (summary["first_loss"], summary["last_loss"]) == (
        reference["first_loss"],
        reference["last_loss"],
    )
    out = tmp_path / "exported"
    _ok(_run(["export", str(run), "--out", str(out)]))
    assert_same_weights(out, finished_run / "hf_model")


def _logged(run: Path, rows: int) -> Callable[[], bool]:
    """A trigger: ``run``'s metrics.jsonl holds ``rows`` lines."""
    metrics = run / "metrics.jsonl"
    return lambda: metrics.is_file() and metrics.read_text().count("\n") >= rows


def _stop_line(log: Path) -> str:
    """The run's one stop line; no traceback from any process."""
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("train-recipes sft: stopped")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher reads /proc")
@pytest.mark.timeout(600)
def test_sigterm_to_the_launcher_saves_the_step_and_resume_is_exact(
    finished_run: Path, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """Issue 43 item 4 and issue 42 item 6: SIGTERM to the launcher stops the rank at the next
    step boundary with a checkpoint of that step, one line and exit 143, no traceback
    (torchrun's agent used to end it at once, print its SignalException and save nothing);
    --resume then ends with the uninterrupted run's losses, bit for bit. (Two ranks agreeing on
    the step, the launcher forwarding to each rank, a second signal and the grace period:
    test_preemption.py.)"""
    run = tmp_path / "run"
    cmd = _cmd(demo_data, run, checkpoint_every=0)
    with _running_until(cmd, _logged(run, 1), tmp_path / "run.log", timeout=400) as launcher:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 143
    line = _stop_line(tmp_path / "run.log")
    stopped = re.fullmatch(
        r"train-recipes sft: stopped at step (\d+) by SIGTERM; checkpoint (step_\d+); "
        r"continue with --resume",
        line,
    )
    assert stopped is not None, line
    step = int(stopped[1])
    assert 1 <= step < 7 and stopped[2] == f"step_{step:06d}"
    assert _checkpoints(run) == [stopped[2]]  # checkpoint_every=0: the stop's alone
    assert sorted(_rows(run)) == list(range(1, step + 1))

    _ok(_run([*cmd, "--resume"], timeout=400))
    got, want = _rows(run), _rows(finished_run)
    assert sorted(got) == sorted(want) == list(range(1, 8))
    for s in want:
        for key in ("loss", "loss_avg_window", "lr", "grad_norm"):
            assert got[s][key] == want[s][key], (s, key, got[s][key], want[s][key])
