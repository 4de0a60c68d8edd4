"""The first day with your own model and data (issue 42): defaults that follow the model, the
data report and the over-long policy, chat templates, ranks from the config, extras per
environment, MLflow's store, and config errors reported before torch is imported."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import CLI, QUIET_CPU_RUN, SHIPPED_CONFIGS, cli_env, sft_args
from train_recipes.cli.main import main
from train_recipes.config import ConfigError, SFTConfig, load_config
from train_recipes.data.demo import DemoSplit


@pytest.fixture(scope="module")
def own_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama folders (max_position_embeddings 256) with the demo's character tokenizer:
    "chat" has its chat template, "plain" has none."""
    from train_recipes.data.demo import build_char_tokenizer
    from train_testing import tiny_hf

    root = tmp_path_factory.mktemp("own")
    folders = {}
    for name in ("chat", "plain"):
        tokenizer = build_char_tokenizer()
        if name == "plain":
            tokenizer.chat_template = None
        special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
        model = tiny_hf.tiny_model("llama", vocab_size=len(tokenizer), bos_token_id=None, **special)
        folders[name] = tiny_hf.save_tiny(model, root / name, tokenizer=tokenizer)
    return folders


def _show(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    """``config show`` in this process: the shown config and the whole output."""
    assert main(["config", "show", *argv]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    return yaml.safe_load(out), out


def _sets(*items: str) -> list[str]:
    return [word for item in items for word in ("--set", item)]


def test_own_model_takes_fine_tuning_defaults_and_given_keys_win(
    own_models: dict[str, Path], demo_data: DemoSplit, capsys: pytest.CaptureFixture[str]
) -> None:
    own = _sets(f"model.path={own_models['chat']}", f"data.path={demo_data.energon_dir}")
    shown, out = _show(own, capsys)
    # Not the demo's 32 tokens, lr 3e-3, micro-batches of 32 and 1,000 steps.
    assert shown["data"]["max_length"] == 256  # the model's max_position_embeddings
    assert shown["data"]["micro_batch_size"] == 4 and shown["optim"]["lr"] == 2e-5
    assert shown["train"]["epochs"] == 3 and shown["optim"]["warmup_steps"] == 0
    notes = [line for line in out.splitlines() if line.startswith("# ") and ": " in line]
    assert any("data.max_length=256 (max_position_embeddings 256)" in n for n in notes), notes
    # The data report: the rows' lengths under the run's tokenizer and template, in two lines.
    report = [n for n in notes if n.startswith("# data: ")]
    assert len(report) == 2, notes
    assert "tokens per row min " in report[0] and "trained tokens per row median" in report[0]
    assert "no row is over data.max_length=256" in report[1]
    mine = _sets("optim.lr=1e-3", "data.max_length=64", "train.steps=5")
    shown, out = _show([*own, *mine], capsys)
    assert shown["optim"]["lr"] == 1e-3 and shown["data"]["max_length"] == 64
    assert shown["train"]["steps"] == 5 and shown["train"]["epochs"] is None
    (note,) = [line for line in out.splitlines() if "defaults for your own model" in line]
    assert "optim.lr" not in note and "data.max_length" not in note and "epochs" not in note
    # The demo keeps the demo's values.
    shown, _ = _show([], capsys)
    assert shown["data"]["max_length"] == 32 and shown["optim"]["lr"] == 3e-3


def test_own_model_with_held_out_chats_measures_the_held_out_loss_before_and_after(
    own_models: dict[str, Path], demo_data: DemoSplit
) -> None:
    """Issue 42: a held-out metric that moves for any task. Exact match stays at 0% for long
    answers, so an own-model run with held-out chats (data.eval_path, or data.eval_split's rows
    of a chat file) evaluates the held-out loss before training, every EVAL_EVERY steps and at
    the end (test_train_loop.py checks the step-0 record); without held-out chats, or with the
    key given, nothing changes."""
    from train_recipes.cli.config_commands import given_keys
    from train_recipes.config.defaults import EVAL_EVERY, apply_run_defaults

    base = [f"model.path={own_models['chat']}", f"data.path={demo_data.energon_dir}"]
    for extra, want in (
        ([f"data.eval_path={demo_data.eval_jsonl}"], EVAL_EVERY),
        ([], 0),
        ([f"data.eval_path={demo_data.eval_jsonl}", "train.eval_every=7"], 7),
    ):
        sets = [*base, *extra]
        config, note = apply_run_defaults(
            load_config(SFTConfig, None, sets), given_keys(None, sets)
        )
        assert config.train.eval_every == want, (extra, config.train.eval_every)
        assert (f"train.eval_every={EVAL_EVERY}" in str(note)) == (want == EVAL_EVERY), note


def test_own_data_that_would_train_nothing_is_refused_before_launch(
    own_models: dict[str, Path],
    demo_data: DemoSplit,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "run"
    sets = [
        f"model.path={own_models['chat']}",
        f"data.path={demo_data.energon_dir}",
        "data.max_length=8",  # every demo row is longer
        "train.steps=2",
        *QUIET_CPU_RUN,
    ]
    assert main(sft_args(out, sets)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config key 'data.max_length'" in err
    assert "100% of the trained tokens would be lost" in err and "data.overlong=skip" in err
    assert not out.exists() or not any(out.iterdir())  # no rank started, nothing written
    assert main(sft_args(out, [*sets, "data.overlong=error"])) == 2
    err = capsys.readouterr().err
    assert "config key 'data.overlong'" in err and "raise data.max_length" in err


def test_tokenizer_without_template_is_refused_and_data_chat_template_names_one(
    own_models: dict[str, Path],
    demo_data: DemoSplit,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from train_recipes.data.chat_templates import TEMPLATES
    from train_recipes.data.processors import load_tokenizer

    plain = [f"model.path={own_models['plain']}", f"data.path={demo_data.energon_dir}"]
    assert main(["config", "show", *_sets(*plain)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config key 'data.chat_template'" in err
    assert "has no chat template" in err and "chatml" in err
    _show(_sets(*plain, "data.chat_template=chatml"), capsys)
    config = load_config(SFTConfig, None, [*plain, "data.chat_template=chatml"])
    assert load_tokenizer(config).chat_template == TEMPLATES["chatml"].source
    jinja = tmp_path / "mine.jinja"
    jinja.write_text("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    config = load_config(SFTConfig, None, [*plain, f"data.chat_template={jinja}"])
    assert load_tokenizer(config).chat_template == jinja.read_text()
    assert main(["config", "show", *_sets(*plain, "data.chat_template=nope")]) == 2
    err = capsys.readouterr().err
    assert "config key 'data.chat_template'" in err and "'nope' is neither" in err


@pytest.mark.timeout(600)
def test_a_run_on_own_data_reports_before_launch_and_counts_dropped_rows_once(
    own_models: dict[str, Path], epoch_data: DemoSplit, tmp_path: Path
) -> None:
    """The issue's run: your model (no chat template) and data, with about half the rows over
    data.max_length. The report comes before launch; the dropped rows are counted, not logged
    one line each; the template the run trained with is saved with its tokenizer."""
    out = tmp_path / "run"
    sets = [
        f"model.path={own_models['plain']}",
        f"data.path={epoch_data.energon_dir}",
        "data.chat_template=zephyr",
        "data.max_length=16",  # zephyr renders the addition chats as 15-17 tokens
        "data.overlong=skip",
        "train.steps=2",
        "train.export=false",
        *QUIET_CPU_RUN,
    ]
    done = subprocess.run(
        [*CLI, *sft_args(out, sets)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    defaults = [x for x in lines if "defaults for your own model" in x]
    assert len(defaults) == 1 and "data.max_length" not in defaults[0]  # it was given
    report = [x for x in lines if x.startswith("train-recipes sft: data: ")]
    assert len(report) == 2 and "over data.max_length=16" in report[1], lines
    assert "data.overlong=skip: dropped" in report[1]
    logged = [x for x in done.stderr.splitlines() if "overlong" in x]
    assert len(logged) == 1, logged  # one line for the run, not one per row
    assert "image" not in done.stdout + done.stderr and "media stripped" not in done.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    saved = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    template = saved.get("chat_template") or (out / "tokenizer" / "chat_template.jinja").read_text()
    assert "eos_token" in template and "<|assistant|>" in template
    assert yaml.safe_load((out / "config.yaml").read_text())["launch"]["nproc_per_node"] == 1


def test_configs_record_their_ranks_and_show_prints_the_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in SHIPPED_CONFIGS.glob("*.yaml"):
        assert yaml.safe_load(path.read_text())["launch"]["nproc_per_node"] >= 1, path.name
    mine = tmp_path / "mine.yaml"
    mine.write_text("launch: {nproc_per_node: 2}\ntrain: {steps: 3, device: cpu}\n")
    out = tmp_path / "run"
    _, shown = _show(["--config", str(mine), "--output-dir", str(out)], capsys)
    assert "#   ranks        2 local" in shown
    assert (
        f"#   launch       torchrun --standalone --nproc-per-node 2 -m train_recipes.cli sft --config {mine}"
        in shown
    )
    assert f"#   run folder   {out}: free" in shown
    # --nproc-per-node wins over the config, and the resolved config records it.
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    resolved, shown = _show(
        ["--config", str(mine), "--nproc-per-node", "1", "--output-dir", str(out)], capsys
    )
    assert "#   ranks        1 (this process)" in shown and "(1 rank, in this process)" in shown
    assert resolved["launch"]["nproc_per_node"] == 1
    assert f"#   run folder   {out}: used; " in shown and "--resume" in shown
    # A shipped config's ranks without the flag (its comment once said --nproc-per-node 2).
    _, shown = _show(["--config", "vlm-shapes-cpu"], capsys)
    assert "#   ranks        2 local" in shown


@pytest.mark.parametrize(
    ("made", "extra_files", "expected"),
    [
        ("uv", {"pyproject.toml": "[project]\nname = 'mine'\n"}, "uv add 'train-recipes[lora]'"),
        ("uv", {}, "uv pip install 'train-recipes[lora]'"),
        (
            "pip",
            {"pyproject.toml": "[project]\nname = 'mine'\n"},
            "pip install 'train-recipes[lora]'",
        ),
    ],
)
def test_missing_extra_message_gives_the_command_of_the_environment(
    made: str,
    extra_files: dict[str, str],
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from train_recipes.config import extras

    for name in ("UV", "UV_PROJECT_ENVIRONMENT"):
        monkeypatch.delenv(name, raising=False)
    for name, text in extra_files.items():
        (tmp_path / name).write_text(text)
    venv = tmp_path / ".venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text(
        "home = /usr/bin\n" + ("uv = 0.13.9\n" if made == "uv" else "")
    )
    real_find_spec = extras.importlib.util.find_spec
    monkeypatch.setattr(
        extras.importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "pip" else real_find_spec(name, *a),
    )
    monkeypatch.setattr(extras.sys, "prefix", str(venv))
    assert extras.install_command("lora") == expected
    assert extras.install_hint("lora").startswith("install the extra train-recipes[lora]: ")
    # This clone's own environment: uv sync keeps the extra (--extra), uv run adds it once.
    clone = extras.install_command("lora", "clone")
    assert "uv sync --all-packages --all-groups --extra lora" in clone
    assert "uv run --extra lora" in clone


def test_mlflow_defaults_to_sqlite_in_the_run_folder_and_is_checked_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from train_recipes.loop.trackers import check_trackers, mlflow_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run = tmp_path / "run"
    assert mlflow_tracking_uri(run) == f"sqlite:///{run.resolve()}/mlflow.db"
    # Without SQLAlchemy (mlflow-skinny, or no mlflow extra at all) the sqlite store is refused
    # with the install command; the rest of the test runs as if it were installed.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sqlalchemy" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match="needs SQLAlchemy"):
        check_trackers(("mlflow",), run)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "sqlalchemy" else real_find_spec(name, *a),
    )
    check_trackers(("mlflow",), run)  # the default: a file the run folder will hold
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    with pytest.raises(ConfigError, match="file store") as err:
        check_trackers(("mlflow",), run)
    assert err.value.key == "train.loggers" and "sqlite:///" in str(err.value)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_trackers(("mlflow",), run)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/missing/mlflow.db")
    with pytest.raises(ConfigError, match="does not exist"):
        check_trackers(("mlflow",), run)
    check_trackers(("wandb",), run)  # nothing to check


def test_config_mistakes_are_reported_before_torch_is_imported() -> None:
    """A typo costs no torch import (6-17 s): the schema, the loader and the checks that need
    no model are torch-free, train-engine's DDP/FSDP2 configs included."""
    script = (
        "import sys\n"
        "from train_recipes.cli.main import main\n"
        "for argv in (['sft', '--set', 'train.stepz=1'], ['sft', '--set', 'train.steps=many'],\n"
        "             ['sft', '--config', 'missing.yaml'], ['sft', '--set', 'model.path=/nowhere'],\n"
        "             ['config', 'show', '--set', 'parallel.fsdp.param_dtype=int8'],\n"
        "             ['retrieval', '--set', 'optim.lr=0']):\n"
        "    assert main(argv) == 2, argv\n"
        "try:\n"
        "    main(['sft', '--no-such-flag'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("train-recipes")]
    assert len(errors) == 7 and "config key 'train.stepz': unknown key" in errors[0], errors
    assert "config key 'model.path'" in errors[3] and "unrecognized arguments" in errors[6]
