"""The SFT training loop's basics: LR schedules, held-out loss, epochs, trackers, optional
plot/TensorBoard, non-finite skips, the hang watchdog and the run's start-up output."""

from __future__ import annotations

import importlib.abc
import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from _recipes_workers import metric_rows
from _runs import TinyRun
from _train_loop_workers import (
    eval_loss_run,
    run_sft_expecting_error,
    run_sft_summary,
    watchdog_names_a_sleeping_rank,
    watchdog_names_a_stopped_rank,
)
from conftest import CLI, cli_env, data_overrides
from train_recipes.config import ConfigError, SFTConfig, load_config, validate_sft
from train_recipes.data.demo import DemoSplit, read_jsonl
from train_recipes.run.schedule import (
    build_lr_scheduler,
    energon_train_samples,
    linear_with_floor,
    total_steps,
)


def _loop_run(split: DemoSplit, out: Path) -> TinyRun:
    """The loop tests' run: quiet, no export, unshuffled micro-batches of 8."""
    return TinyRun(data=split, out=out, export=False, micro_batch_size=8, shuffle=False)


# ----------------------------------------------------------------------------------- schedules


def _old_lr_lambda(warmup: int, total: int, floor: float) -> Any:
    """sft.py's ``_lr_lambda`` as it was before the schedule moved to schedule.py (verbatim)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return max(floor, 1.0 - (1.0 - floor) * progress)

    return factor


def _lrs(scheduler: Any, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize(
    ("warmup", "total", "floor"), [(30, 1000, 0.05), (5, 60, 0.1), (0, 7, 0.0)]
)
def test_default_schedule_is_the_old_lambda_bit_for_bit(
    warmup: int, total: int, floor: float
) -> None:
    from train_recipes.config import OptimConfig

    if warmup == 0:
        # The old lambda divided by warmup only below it; 0 warm-up steps never reach that line.
        assert linear_with_floor(warmup_steps=0, total_steps=total, min_lr_ratio=floor)(0) == 1.0
    old, new = (
        _old_lr_lambda(warmup, total, floor),
        linear_with_floor(warmup_steps=warmup, total_steps=total, min_lr_ratio=floor),
    )
    assert [new(s) for s in range(total + 5)] == [old(s) for s in range(total + 5)]
    optim = OptimConfig(lr=3e-3, warmup_steps=warmup, min_lr_ratio=floor)
    opt_a, opt_b = _optimizer(3e-3), _optimizer(3e-3)
    ref = torch.optim.lr_scheduler.LambdaLR(opt_a, old)
    got = build_lr_scheduler(opt_b, optim, total_steps=total)
    assert _lrs(got, opt_b, total + 3) == _lrs(ref, opt_a, total + 3)


@pytest.mark.parametrize("floor", [0.0, 0.05])
def test_cosine_and_constant_match_get_scheduler_step_for_step(floor: float) -> None:
    from transformers import get_scheduler

    from train_recipes.config import OptimConfig

    total, warmup = 50, 7
    opt_a, opt_b = _optimizer(1e-3), _optimizer(1e-3)
    if floor == 0.0:
        ref = get_scheduler("cosine", opt_a, num_warmup_steps=warmup, num_training_steps=total)
    else:
        ref = get_scheduler(
            "cosine_with_min_lr",
            opt_a,
            num_warmup_steps=warmup,
            num_training_steps=total,
            scheduler_specific_kwargs={"min_lr_rate": floor},
        )
    cosine = OptimConfig(lr=1e-3, warmup_steps=warmup, min_lr_ratio=floor, schedule="cosine")
    got = build_lr_scheduler(opt_b, cosine, total_steps=total)
    ref_lrs, got_lrs = _lrs(ref, opt_a, total + 2), _lrs(got, opt_b, total + 2)
    assert got_lrs == ref_lrs
    assert got_lrs[0] == 0.0 and max(got_lrs) == pytest.approx(1e-3)
    assert got_lrs[total] == pytest.approx(1e-3 * floor, abs=1e-12)

    opt_c, opt_d = _optimizer(1e-3), _optimizer(1e-3)
    ref_c = get_scheduler("constant_with_warmup", opt_c, num_warmup_steps=warmup)
    constant = OptimConfig(lr=1e-3, warmup_steps=warmup, schedule="constant")
    got_c = build_lr_scheduler(opt_d, constant, total_steps=total)
    assert _lrs(got_c, opt_d, total) == _lrs(ref_c, opt_c, total)


def test_retrieval_and_sft_share_the_schedule() -> None:
    """One implementation: neither recipe builds its own LambdaLR any more; both take the
    optimizer and its schedule from the shared runtime module, which calls build_lr_scheduler."""
    import train_recipes.retrieval.recipe as retrieval
    import train_recipes.run.runtime as runtime
    import train_recipes.sft.build as sft_build

    assert "build_lr_scheduler(" in Path(runtime.__file__ or "").read_text()
    for module in (retrieval, sft_build):
        source = Path(module.__file__ or "").read_text()
        assert "build_optimizer(" in source and "LambdaLR" not in source, module.__name__


def test_build_optimizer_takes_the_configs_adamw_values() -> None:
    from train_recipes.config import OptimConfig
    from train_recipes.run.runtime import build_optimizer

    optim = OptimConfig(betas=(0.8, 0.9), eps=1e-12, weight_decay=0.1, fused=False)
    model = torch.nn.Linear(3, 2)
    optimizer, _ = build_optimizer(model, optim, device=torch.device("cpu"), total_steps=4)
    assert isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        assert (group["betas"], group["eps"]) == ((0.8, 0.9), 1e-12), group


# ----------------------------------------------------------------------------- held-out loss


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.timeout(240)
def test_logged_eval_loss_equals_a_float64_forward(
    rank_pool: Any, demo_data: DemoSplit, tmp_path: Path, cp: int
) -> None:
    """2 ranks, 13 held-out chats in batches of 4 (dp=2: uneven, filler rows on one rank;
    cp=2: every chat sharded over both ranks): the eval/loss logged at the last step equals the
    float64 token-mean loss of the final model, each chat run alone (no padding) through the
    unmodified HF model."""
    from energon_sft import IGNORE_INDEX, SFTTaskEncoder, cook_chat
    from train_recipes.data.demo import build_char_tokenizer

    run = _loop_run(demo_data, tmp_path / "run").but(
        "train.eval_every=2", "train.eval_loss_samples=13", steps=4, micro_batch_size=4, cp=cp
    )
    out = rank_pool.run(2, eval_loss_run, run.overrides(), timeout_s=200)[0]
    logged = {r["step"]: r["eval/loss"] for r in out["rows"] if "eval/loss" in r}
    assert sorted(logged) == [0, 2, 4]  # step 0: before training (the summary's "before")
    model = out["model"].to(torch.float64).eval()
    tokenizer = build_char_tokenizer()
    encoder = SFTTaskEncoder(
        tokenizer, model_family="text", max_length=32, train_on="all_assistant"
    )
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for i, row in enumerate(list(read_jsonl(demo_data.eval_jsonl))[:13]):
        crude = {"json": row, "__key__": f"k{i}", "__restore_key__": (), "__sources__": ()}
        sample = encoder.encode_chat(cook_chat(crude))
        with torch.no_grad():
            logits = model(input_ids=sample.input_ids[None]).logits[0]  # [S, V] float64
        keep = sample.labels != IGNORE_INDEX
        total += torch.nn.functional.cross_entropy(
            logits[keep], sample.labels[keep], reduction="sum"
        )
        tokens += int(keep.sum())
    reference = float(total / tokens)
    assert logged[4] == pytest.approx(reference, rel=1e-5), (logged, reference)
    assert logged[2] != pytest.approx(logged[4], rel=1e-6)  # it was evaluated twice, not copied
    assert out["summary"]["eval_loss_last"] == logged[4]
    assert out["summary"]["eval_loss_first"] == logged[0] > logged[4]


def test_eval_every_without_held_out_chats_is_refused(demo_data: DemoSplit) -> None:
    config = load_config(
        SFTConfig, None, [f"data.path={demo_data.energon_dir}", "train.eval_every=5"]
    )
    with pytest.raises(ConfigError, match=r"data\.eval_path") as err:
        validate_sft(config, world_size=1)
    assert err.value.key == "train.eval_every"


# ------------------------------------------------------------------------------------ epochs


def test_epochs_derive_the_step_count_and_exclude_steps(demo_data: DemoSplit) -> None:
    assert energon_train_samples(demo_data.energon_dir) == 4000
    base = [*data_overrides(demo_data), "data.micro_batch_size=16"]
    config = load_config(
        SFTConfig, None, [*base, "train.epochs=3", "train.gradient_accumulation_steps=5"]
    )
    validate_sft(config, world_size=2)
    assert total_steps(config, dp=2) == 3 * (4000 // (2 * 16 * 5))  # 3 x 25
    for bad, match in [
        (["train.epochs=1", "train.steps=40"], "mutually exclusive"),
        (["train.epochs=1", "data.packing=true"], "packed row"),
        (["train.epochs=0"], ">= 1"),
        (["train.epochs=1", "data.micro_batch_size=4096"], "less than one global batch"),
    ]:
        with pytest.raises(ConfigError, match=match) as err:
            validate_sft(load_config(SFTConfig, None, [*base, *bad]), world_size=2)
        assert err.value.key == "train.epochs"


@pytest.mark.timeout(240)
def test_an_epoch_run_trains_the_derived_steps(
    rank_pool: Any, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """4000 samples / (dp=2 x 50 x accumulation 2) = 20 steps per epoch."""
    out = tmp_path / "epochs"
    run = _loop_run(demo_data, out).but(
        "train.epochs=1", micro_batch_size=50, accumulation=2, log_every=5
    )
    summary = rank_pool.run(2, run_sft_summary, run.overrides(), timeout_s=200)[0]
    assert summary["steps"] == 20
    rows = metric_rows(out)
    assert [r["step"] for r in rows if "loss" in r] == [5, 10, 15, 20]
    saved = load_config(SFTConfig, out / "config.yaml")
    assert (saved.train.steps, saved.train.epochs) == (20, 1)
    validate_sft(saved, world_size=2)  # config.yaml says what trained, and is still valid


# ------------------------------------------------------------------------------- import hooks


class _Hide(importlib.abc.MetaPathFinder):
    """Makes ``import NAME`` (and its submodules) fail as if NAME were not installed."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.split(".")[0] in self.names or fullname in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by the test)")
        return None


@pytest.fixture
def hide(monkeypatch: pytest.MonkeyPatch) -> Any:
    def apply(*names: str) -> None:
        for mod in list(sys.modules):
            if mod.split(".")[0] in names or mod in names:
                monkeypatch.delitem(sys.modules, mod)
        monkeypatch.setattr(sys, "meta_path", [_Hide(*names), *sys.meta_path])

    return apply


def test_missing_tracker_extra_is_a_one_line_config_error(hide: Any, demo_data: DemoSplit) -> None:
    from train_recipes.cli.preflight import check_extras
    from train_recipes.loop.trackers import open_trackers

    hide("wandb", "mlflow")
    for name in ("wandb", "mlflow"):
        config = load_config(
            SFTConfig, None, [*data_overrides(demo_data), f"train.loggers=[{name}]"]
        )
        validate_sft(config, world_size=1)
        with pytest.raises(ConfigError, match=rf"train-recipes\[{name}\]") as err:
            check_extras(config)  # the preflight, before any rank starts
        assert err.value.key == "train.loggers" and "\n" not in str(err.value)
        with pytest.raises(
            ImportError, match=rf"^train.loggers lists '{name}'.*train-recipes\[{name}\]"
        ):
            open_trackers(Path("."), tensorboard=False, loggers=[name], run_name="r", config={})


def test_missing_matplotlib_and_tensorboard_give_notices(
    hide: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from train_recipes.loop.metrics import RunLogger, loss_plot_or_notice, plot_loss
    from train_recipes.loop.records import LoopPlan, RunStart

    hide("matplotlib", "tensorboard", "torch.utils.tensorboard")
    plan = LoopPlan(total_steps=2, log_every=1)
    log = RunLogger(RunStart(output_dir=tmp_path, plan=plan, tensorboard=True), enabled=True)
    log.log(1, {"loss": 1.0, "loss_avg_window": 1.0})
    log.close()
    assert loss_plot_or_notice(tmp_path) is None
    lines = [x for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert len(lines) == 2, lines
    assert "tensorboard is not installed" in lines[0] and "train-recipes[tensorboard]" in lines[0]
    assert "matplotlib" in lines[1] and "train-recipes[plot]" in lines[1]
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "loss.png").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0
    with pytest.raises(ImportError, match=r"train-recipes\[plot\]"):
        plot_loss(tmp_path)


class _TimedStages:
    """Loop stages that take known times: evaluation before training 1 s, each step 0.1 s."""

    def train_step(self, step: int) -> Any:
        from train_recipes.loop.records import StepRecord

        time.sleep(0.1)
        return StepRecord(step=step, metrics={"loss": 1.0, "loss_avg_window": 1.0, "lr": 1e-3})

    def evaluate(self, step: int) -> Any:
        from train_recipes.loop.records import StepRecord

        time.sleep(1.0 if step == 0 else 0.0)
        return StepRecord(step=step)

    def checkpoint(self, step: int) -> None:
        pass

    def finish(self) -> Any:
        from train_recipes.loop.records import RunEnd, StepRecord

        return RunEnd(record=StepRecord(step=0), summary={})


def test_progress_bar_rate_counts_from_the_first_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rate the bar prints, the first included, is steps over the time since the first
    step began (about 10 it/s here): not over the bar's own age (it was 323634.57it/s at the
    first update), nor counting the evaluation before training."""
    from train_recipes.loop import drive as loop
    from train_recipes.loop.records import LoopPlan, RunStart

    monkeypatch.setattr(loop, "loss_plot_or_notice", lambda out_dir: None)
    plan = LoopPlan(total_steps=3, log_every=1)
    start = RunStart(output_dir=tmp_path, plan=plan, tensorboard=False, desc="sft")
    capsys.readouterr()
    loop.drive(_TimedStages(), start, is_main=True, format_summary=lambda *_: "")  # type: ignore[arg-type]
    err = capsys.readouterr().err
    rates = [float(r) if unit == "it/s" else 1 / float(r) for r, unit in _RATE.findall(err)]
    assert len(rates) >= 3, err
    assert all(2 < r < 50 for r in rates), (rates, err)


_RATE = re.compile(r"([\d.]+)(it/s|s/it)")


class _Recorder:
    """A stand-in module (or run object) that records every call made on it."""

    def __init__(self, name: str, calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> None:
        self._name, self._calls = name, calls

    def __getattr__(self, attr: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls.append((f"{self._name}.{attr}", args, kwargs))
            return _Recorder(f"{self._name}.{attr}()", self._calls)

        return call


def test_wandb_and_mlflow_receive_the_records(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from train_recipes.loop.metrics import RunLogger
    from train_recipes.loop.records import LoopPlan, RunStart

    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    for name in ("wandb", "mlflow"):
        fake = types.ModuleType(name)
        recorder = _Recorder(name, calls)
        fake.__getattr__ = recorder.__getattr__  # type: ignore[method-assign]
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    config = {"optim": {"lr": 0.003}, "train": {"steps": 2}}
    start = RunStart(
        output_dir=tmp_path / "run1",
        plan=LoopPlan(total_steps=2, log_every=1),
        tensorboard=False,
        loggers=("wandb", "mlflow"),
        run_config=config,
    )
    log = RunLogger(start, enabled=True)
    log.log(1, {"loss": 2.5, "lr": 1e-3, "skipped": [1], "skipped_total": 1, "eval/recall@10": 0.5})
    log.log(2, {"loss": float("nan")})  # nothing finite: not sent
    log.close()
    names = [c[0] for c in calls]
    assert names == [
        "wandb.init",
        "mlflow.set_tracking_uri",
        "mlflow.set_experiment",
        "mlflow.start_run",
        "mlflow.log_params",
        "wandb.init().log",
        "mlflow.log_metrics",
        "wandb.init().finish",
        "mlflow.end_run",
    ]
    by_name = {c[0]: c for c in calls}
    init = by_name["wandb.init"][2]
    assert init["project"] == "train-recipes" and init["name"] == "run1"
    assert init["config"] == config and init["dir"] == str(tmp_path / "run1")
    sent = {"loss": 2.5, "lr": 1e-3, "skipped_total": 1.0, "eval/recall@10": 0.5}
    assert by_name["wandb.init().log"][1:] == ((sent,), {"step": 1})
    mlflow_sent = {**sent, "eval/recall_10": 0.5}
    del mlflow_sent["eval/recall@10"]
    assert by_name["mlflow.log_metrics"][1:] == ((mlflow_sent,), {"step": 1})
    assert by_name["mlflow.log_params"][1] == ({"optim.lr": "0.003", "train.steps": "2"},)
    # Not the file store ./mlruns, which current mlflow refuses: SQLite in the run folder.
    db = (tmp_path / "run1" / "mlflow.db").resolve()
    assert by_name["mlflow.set_tracking_uri"][1][0] == f"sqlite:///{db}"
    # W&B writes <dir>/wandb (offline runs too): --overwrite clears it with the rest of the run
    # (it refused the folder as not a run's).
    from train_recipes.run.folder import check_output_dir, clear_run

    (tmp_path / "run1" / "wandb" / "offline-run-20260101_000000-abc123").mkdir(parents=True)
    (tmp_path / "run1" / "mlflow.db").touch()
    check_output_dir(tmp_path / "run1", resume=False, overwrite=True)
    assert sorted(clear_run(tmp_path / "run1")) == ["metrics.jsonl", "mlflow.db", "wandb"]
    assert not any((tmp_path / "run1").iterdir())


# ------------------------------------------------------------------------------------- skips


@pytest.mark.timeout(240)
def test_lr_1e30_skips_19_of_20_steps_and_reports_them(
    rank_pool: Any, demo_data: DemoSplit, tmp_path: Path
) -> None:
    out = tmp_path / "skips"
    run = _loop_run(demo_data, out).but("train.max_consecutive_skips=0", steps=20, lr=1e30)
    summary = rank_pool.run(2, run_sft_summary, run.overrides(), timeout_s=200)[0]
    assert summary["steps"] == 20
    assert summary["skipped_steps"] == list(range(2, 21))
    assert summary["device"] == "cpu (gloo)" and summary["attention"].startswith("sdpa")
    assert list(summary["startup_s"]) == [
        "building data",
        "building model",
        "wrapping",
        "building loader",
        "first step",
    ]
    rows = metric_rows(out)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["skipped"] for r in train_rows] == [[]] + [[s] for s in range(2, 21)]
    assert [r["skipped_total"] for r in train_rows] == [0, *range(1, 20)]


@pytest.mark.timeout(240)
def test_nonfinite_raise_policy_is_the_engines(
    rank_pool: Any, demo_data: DemoSplit, tmp_path: Path
) -> None:
    run = _loop_run(demo_data, tmp_path / "raise").but("optim.nonfinite=raise", steps=5, lr=1e30)
    errors = rank_pool.run(2, run_sft_expecting_error, run.overrides(), timeout_s=200)
    assert all(e.startswith("NonFiniteGradientError") for e in errors), errors


@pytest.mark.timeout(300)
def test_a_run_that_trains_no_token_fails_and_its_skips_survive_a_resume(
    rank_pool: Any, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """Issue 43 items 2 and 6, on the recipe itself (the CLI's data report refuses this config
    before launch, from a sample of the rows; the rows after it may still be all masked): with
    every label cut off (data.max_length=3) each step trains no token, a skipped step with no
    optimizer update (so weight decay moves nothing), and a run whose every step was skipped
    fails on every rank and exports nothing. The skips and the run of skips live in the
    checkpoint: the resume counts on from 3 (skipped_total 4 at step 4) and aborts at step 5
    on max_consecutive_skips=5 (both counts restarted at 0 before)."""
    out = tmp_path / "masked"
    masked = _loop_run(demo_data, out).but(
        "data.max_length=3", "optim.weight_decay=0.1", export=True
    )
    errors = rank_pool.run(
        2, run_sft_expecting_error, masked.but(steps=3).overrides(), timeout_s=240
    )
    assert all(e.startswith("TrainingAborted: none of the run's 3 steps") for e in errors), errors
    assert "data.max_length=3" in errors[0] and "nothing was exported" in errors[0]
    assert not (out / "hf_model").exists() and not (out / "summary.json").exists()
    marker = json.loads((out / "checkpoints" / "step_000003" / "COMPLETE").read_text())
    assert marker["optimizer_steps"] == 0, marker
    rows = {r["step"]: r for r in metric_rows(out) if "loss" in r}
    assert [rows[s]["skipped"] for s in (1, 2, 3)] == [[1], [2], [3]]
    assert [rows[s]["loss_tokens"] for s in (1, 2, 3)] == [0, 0, 0]

    longer = masked.but("train.max_consecutive_skips=5", steps=8).overrides()
    errors = rank_pool.run(2, run_sft_expecting_error, longer, True, timeout_s=240)
    assert all("steps 1-5: 5 optimizer steps in a row" in e for e in errors), errors
    assert "trained no token" in errors[0]
    rows = {r["step"]: r for r in metric_rows(out) if "loss" in r}
    assert sorted(rows) == [1, 2, 3, 4]  # step 5's record is not written: the run aborts in it
    assert rows[4]["skipped"] == [4] and rows[4]["skipped_total"] == 4


def test_skip_tracker_names_the_recipe_step_and_aborts() -> None:
    from train_recipes.run.health import SkipTracker, TrainingAborted

    class Result:  # a StepResult: the Engine counts the skips in a row
        def __init__(self, skipped: bool, consecutive_skipped_steps: int) -> None:
            self.skipped = skipped
            self.consecutive_skipped_steps = consecutive_skipped_steps
            self.no_loss_tokens = False

    said: list[int] = []
    tracker = SkipTracker(3, on_skip=lambda step, empty: said.append(step))
    tracker.observe(1, Result(False, 0))  # type: ignore[arg-type]
    tracker.observe(2, Result(True, 1))  # type: ignore[arg-type]
    assert said == []  # read one step late (no host sync on a fused optimizer)
    tracker.observe(3, Result(False, 0))  # type: ignore[arg-type]
    assert said == [2]
    tracker.observe(4, Result(True, 1))  # type: ignore[arg-type]
    tracker.observe(5, Result(True, 2))  # type: ignore[arg-type]
    tracker.observe(6, Result(True, 3))  # type: ignore[arg-type]
    assert tracker.new_since_last_call() == [2, 4, 5]
    with pytest.raises(TrainingAborted, match=r"steps 4-6: 3 optimizer steps in a row"):
        tracker.flush()
    assert said == [2, 4, 5, 6]


def test_skip_tracker_continues_from_a_checkpoints_state() -> None:
    """The skipped steps and the run of skips survive a resume (issue 43 item 6): the Engine's
    count restarts at 0 after a load, the tracker adds the run the checkpoint ended with."""
    from train_recipes.run.health import SkipTracker, TrainingAborted

    class Result:
        def __init__(self, skipped: bool, in_a_row: int, empty: bool = False) -> None:
            self.skipped, self.consecutive_skipped_steps = skipped, in_a_row
            self.no_loss_tokens = empty

    saved = SkipTracker(4, on_skip=lambda step, empty: None)
    for step, result in [(1, Result(False, 0)), (2, Result(True, 1, True)), (3, Result(True, 2))]:
        saved.observe(step, result)  # type: ignore[arg-type]
    saved.flush()
    resumed = SkipTracker(4, on_skip=lambda step, empty: None)
    resumed.load_state_dict(saved.state_dict())
    resumed.observe(4, Result(True, 1))  # type: ignore[arg-type]
    resumed.observe(5, Result(True, 2))  # type: ignore[arg-type]
    with pytest.raises(TrainingAborted, match=r"steps 2-5: 4 optimizer steps in a row.* 1 trained"):
        resumed.flush()
    assert resumed.skipped == [2, 3, 4, 5] and resumed.empty == [2]
    assert resumed.new_since_last_call() == [4, 5]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_consecutive_skips_abort_with_one_line_after_clean_startup_output(
    demo_data: DemoSplit, tmp_path: Path
) -> None:
    """One CLI run: the start-up header and phases, the held-out accuracy line on its own (no
    progress bar yet), the skips named by their step, then the abort as one line, exit 1."""
    done = subprocess.run(
        [
            *CLI,
            *_loop_run(demo_data, tmp_path / "abort")
            .but(steps=40, lr=1e30, eval_samples=8)
            .cli_args(),
        ],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [x for x in done.stderr.splitlines() if x.startswith("train-recipes sft:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "steps 2-11: 10 optimizer steps in a row" in errors[0]
    assert "train.max_consecutive_skips=10" in errors[0]
    assert "step 2: optimizer update skipped" in done.stdout
    assert "step 12: optimizer" not in done.stdout
    assert "skipped the update of step" not in done.stderr  # the engine's per-rank warning

    lines = done.stdout.splitlines()
    # The launcher's data report comes first, before any rank starts.
    assert lines[0].startswith("train-recipes sft: data: 256 rows from the start of"), lines[:3]
    lines = [x for x in lines if not x.startswith("train-recipes sft: data: ")]
    assert lines[0].startswith("sft: 1 ranks (dp=1, cp=1, tp=1, ddp) on cpu (gloo); attention sdpa")
    assert [x.split(maxsplit=2)[:2] for x in lines[1:7]] == [
        ["building", "data"],
        ["building", "model"],
        ["wrapping", lines[3].split()[1]],
        ["building", "loader"],
        ["optimizer:", "torch.optim.AdamW"],  # fp32 tiny model: no master weights
        ["held-out", "exact"],
    ], lines[:9]
    assert lines[6].startswith("held-out exact match before training: 0.0% (8 questions)")
    assert lines[7].startswith("first step"), lines[:9]
    # Nothing of a progress bar before the first step: the bar starts with the first step.
    assert "it/s" not in "\n".join(lines[:8])


def test_summary_names_device_attention_startup_and_skips(tmp_path: Path) -> None:
    from train_recipes.sft.summary import summary_table

    summary = {
        "accuracy_before": None,
        "accuracy_after": None,
        "world_size": 2,
        "dp": 2,
        "cp": 1,
        "tp": 1,
        "device": "cuda:0 (NVIDIA H200, nccl)",
        "attention": "sdpa (backends cudnn, flash), bfloat16",
        "startup_s": {"building data": 1.25, "first step": 3.0},
        "steps": 20,
        "skipped_steps": list(range(2, 21)),
        "first_loss": 2.0,
        "last_loss": float("nan"),
        "eval_loss_first": 2.5,
        "eval_loss_last": 2.25,
    }
    table = summary_table(summary, tmp_path, None, None).splitlines()
    assert "device         cuda:0 (NVIDIA H200, nccl)" in table
    assert "attention      sdpa (backends cudnn, flash), bfloat16" in table
    assert "start-up       building data 1.2 s, first step 3.0 s" in table
    assert "skipped        19 (steps 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ...)" in table
    assert "eval loss      2.5000 -> 2.2500 (held-out)" in table
    assert "loss curve     -" in table


# ------------------------------------------------------------------------------ hung ranks


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_watchdog_names_a_rank_that_does_not_arrive(rank_pool: Any) -> None:
    """Rank 1 sleeps before step 5. The timeout is 3 s; the measured warm-up steps tighten the
    limit to its floor (1 s here): rank 0's watchdog names rank 1 after that, not after 3 s."""
    result = rank_pool.run(2, watchdog_names_a_sleeping_rank, 3.0, timeout_s=60)[0]
    assert result["limit_s"] == 1.0
    assert result["message"] is not None
    assert "rank 1 (last seen at step 4) did not reach step 5" in result["message"]
    assert "limit 1 s, train.collective_timeout_s=3" in result["message"]
    assert 1.0 <= result["after_s"] < 2.5, result


@pytest.mark.serial
@pytest.mark.timeout(120)
def test_watchdog_names_a_sigstopped_rank(rank_pool: Any) -> None:
    """Rank 1 is SIGSTOPped inside step 5 (same step as rank 0): its heartbeat freezes."""
    result = rank_pool.run(2, watchdog_names_a_stopped_rank, 3.0, timeout_s=60)[0]
    assert result["message"] is not None
    assert "rank 1 stopped responding" in result["message"], result
    # Counted from its last heartbeat, which came at most one interval (0.1 s) before the stop.
    assert 3.0 - 0.15 <= result["after_s"] < 8.0, result


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_stopped_rank_fails_the_run_naming_it(demo_data: DemoSplit, tmp_path: Path) -> None:
    """End to end: 2 ranks through torchrun, rank 1 SIGSTOPped mid-run, collective timeout 8 s:
    the run fails with one line naming rank 1, long before the 600 s default."""
    import signal

    out = tmp_path / "hang"
    proc = subprocess.Popen(
        [
            *CLI,
            *_loop_run(demo_data, out)
            .but("train.collective_timeout_s=8", steps=100000)
            .cli_args(nproc=2),
        ],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rank1 = None
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and metrics.read_text().count("\n") >= 6:
                rank1 = _rank_pid(proc.pid, 1)
                if rank1 is not None:
                    break
            time.sleep(0.2)
        assert rank1 is not None, "the run did not reach step 6"
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        line = proc.stderr.readline() if proc.stderr else ""
        while line and "did not reach" not in line and "stopped responding" not in line:
            line = proc.stderr.readline() if proc.stderr else ""
        reported_after = time.monotonic() - stopped_at
        os.kill(rank1, signal.SIGCONT)  # lets the launcher's SIGTERM end it
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    line = line.split("\r")[-1]  # a progress bar cleared before the line (not a terminal here)
    assert line.startswith("train-recipes: rank 1"), line
    assert "train.collective_timeout_s=8" in line, line
    # The watchdog's limit (8 s) plus its heartbeat interval, before the group's own 13 s.
    assert reported_after < 8 + 3, (reported_after, line)


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the launcher's child process with RANK=rank (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None
