"""`config ls|cp|show` and the config keys in `--help`: the shipped configs are discoverable."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import SHIPPED_CONFIGS, model_and_data_stand_ins, shipped_world_size
from train_recipes.cli.config_commands import given_keys, header, shipped_configs
from train_recipes.cli.main import main
from train_recipes.config import RetrievalConfig, SFTConfig, load_config, to_dict
from train_recipes.config.defaults import apply_run_defaults
from train_recipes.config.dpo import DPOConfig
from train_recipes.config.grpo import GRPOConfig
from train_recipes.config.key_help import config_keys


def _recipe_of(name: str) -> str:
    """The recipe a shipped config is for, by its name."""
    if name.startswith("retrieval"):
        return "retrieval"
    for recipe in ("dpo", "grpo"):
        if name.removesuffix(".yaml").endswith(f"-{recipe}"):
            return recipe
    return "sft"


def test_config_ls_lists_every_shipped_config(capsys: pytest.CaptureFixture[str]) -> None:
    names = sorted(p.name for p in SHIPPED_CONFIGS.glob("*.yaml"))
    assert len(names) >= 6 and sorted(shipped_configs()) == names
    assert main(["config", "ls"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[0] for line in lines] == names
    for line in lines:
        name, recipe = line.split()[:2]
        assert recipe == _recipe_of(name), line
        assert header((SHIPPED_CONFIGS / name).read_text()) in line


def test_config_cp_copies_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "cp", "demo-cpu", str(tmp_path)]) == 0
    copied = tmp_path / "demo-cpu.yaml"
    assert capsys.readouterr().out.strip() == str(copied)
    assert copied.read_bytes() == (SHIPPED_CONFIGS / "demo-cpu.yaml").read_bytes()
    assert main(["config", "cp", "demo-cpu.yaml", str(copied)]) == 2
    assert "exists" in capsys.readouterr().err
    target = tmp_path / "sub" / "mine.yaml"
    assert main(["config", "cp", "retrieval-minilm.yaml", str(target)]) == 0
    assert main(["config", "cp", "retrieval-minilm.yaml", str(target), "--force"]) == 0
    assert target.read_bytes() == (SHIPPED_CONFIGS / "retrieval-minilm.yaml").read_bytes()
    capsys.readouterr()
    assert main(["config", "cp", "nope", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "demo-cpu.yaml" in err


@pytest.mark.parametrize("name", sorted(p.name for p in SHIPPED_CONFIGS.glob("*.yaml")))
def test_config_show_validates_each_shipped_config(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _recipe_of(name)
    cls = {"sft": SFTConfig, "retrieval": RetrievalConfig, "dpo": DPOConfig, "grpo": GRPOConfig}[
        recipe
    ]
    argv = ["config", "show", "--config", name, "--nproc-per-node", str(shipped_world_size(name))]
    # Cluster paths do not exist here: point them at stand-ins, as a user sets their own.
    model, data = model_and_data_stand_ins(tmp_path)
    as_shipped = load_config(cls, SHIPPED_CONFIGS / name)
    if getattr(as_shipped.model, "path", None) is not None:
        argv += ["--set", f"model.path={model}"]
    if getattr(as_shipped.data, "path", None) is not None:
        argv += ["--set", f"data.path={data}"]
    if getattr(as_shipped.train, "device", "auto") == "cuda":
        argv += ["--set", "train.device=auto"]  # no GPU here; the rest is what we validate
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    # The output is a config file: the resolved values, then the plan as comments.
    shown = yaml.safe_load(out)
    sets = [a for a in argv if "=" in a]
    expected = load_config(cls, SHIPPED_CONFIGS / name, sets)
    if isinstance(expected, SFTConfig):  # a model folder's defaults for the keys left unset
        given = given_keys(SHIPPED_CONFIGS / name, sets)
        expected, _ = apply_run_defaults(expected, given)
    assert shown == to_dict(expected)
    assert expected.launch.nproc_per_node == shipped_world_size(name)
    plan = {line.split()[1]: line for line in out.splitlines() if line.startswith("#   ")}
    assert f"recipe       {recipe}" in plan["recipe"]
    world = shipped_world_size(name)
    cp, tp = expected.parallel.cp, expected.parallel.tp
    assert f"dp={world // (cp * tp)} x cp={cp} x tp={tp}" in plan["mesh"]
    assert {"device", "attention", "wrapping", "ranks"} <= set(plan)


def test_config_show_is_the_dry_run_for_bad_configs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", "--set", "parallel.cp=2", "--nproc-per-node", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train-recipes config show: config key 'parallel.cp'")
    assert err.count("\n") == 1
    # A file for the retrieval recipe is recognised by its keys.
    mine = tmp_path / "mine.yaml"
    mine.write_text("model: {pooling: cls}\ntrain: {steps: 7}\n")
    assert main(["config", "show", "--config", str(mine)]) == 0
    out = capsys.readouterr().out
    assert "recipe       retrieval" in out and yaml.safe_load(out)["train"]["steps"] == 7
    mine.write_text("model: {pooling: cls, hidden: 3}\n")
    assert main(["config", "show", "--config", str(mine)]) == 2
    assert "'model.hidden'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "cls"),
    [
        ("sft", SFTConfig),
        ("retrieval", RetrievalConfig),
        ("dpo", DPOConfig),
        ("grpo", GRPOConfig),
    ],
)
def test_help_lists_every_config_key_with_type_and_default(
    command: str, cls: type, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    keys = list(config_keys(cls))
    assert len(keys) == len(to_flat_keys(to_dict(cls())))
    for doc in keys:
        assert f"  {doc.key}  ({doc.type}, default {doc.default})" in out, doc
    if command == "dpo":
        assert "  loss.loss_type  (sigmoid|simpo, default sigmoid)" in out
        assert "  optim.lr  (float, default 1.0e-05)" in out
    elif command == "grpo":
        assert "  loss.kl_estimator  (k1|k3, default k3)" in out
        assert "  optim.lr  (float, default 0.0001)" in out
    elif command == "sft":
        assert "  optim.lr  (float, default 0.003)" in out
        assert "  data.demo  (addition|reverse|shapes, default addition)" in out
        assert "  optim.max_grad_norm  (float | null, default 1.0)" in out
    else:  # the recipe's own defaults, not the section's
        assert "  optim.lr  (float, default 5.0e-05)" in out
        assert "  model.autocast_dtype  (bfloat16 | null, default null)" in out


def to_flat_keys(tree: dict[str, object], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += to_flat_keys(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def test_config_accepts_a_shipped_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--config", "demo-cpu"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == to_dict(load_config(SFTConfig, SHIPPED_CONFIGS / "demo-cpu.yaml"))
