"""Config loading, overrides and validation: every bad config is rejected naming its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from train_recipes.cli import main
from train_recipes.config import (
    ConfigError,
    RetrievalConfig,
    SFTConfig,
    config_from_dict,
    load_config,
    to_dict,
    validate_retrieval,
    validate_sft,
)

CONFIGS = Path(__file__).parents[1] / "configs"


def _fake_model_and_data(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    data = tmp_path / "data"
    (data / ".nv-meta").mkdir(parents=True)
    return model, data


def _world_for(path: Path) -> int:
    return {"qwen-8gpu-cp2.yaml": 8, "demo-cpu-cp2.yaml": 4, "llama-1b5-1gpu.yaml": 1}.get(
        path.name, 2
    )


@pytest.mark.skipif(
    not CONFIGS.is_dir(), reason="configs/ folder not present (installed-wheel run)"
)
def test_every_shipped_config_loads_and_validates(tmp_path: Path) -> None:
    files = sorted(CONFIGS.glob("*.yaml"))
    assert len(files) >= 5, files
    model, data = _fake_model_and_data(tmp_path)
    for path in files:
        cls = RetrievalConfig if path.name.startswith("retrieval") else SFTConfig
        config = load_config(cls, path)
        # Paths on a GPU cluster do not exist here: point them at stand-ins, validate the rest.
        overrides = []
        if getattr(config.model, "path", None) is not None:
            overrides.append(f"model.path={model}")
        if getattr(config.data, "path", None) is not None:
            overrides.append(f"data.path={data}")
        config = load_config(cls, path, overrides)
        if isinstance(config, SFTConfig):
            validate_sft(config, world_size=_world_for(path))
        else:
            validate_retrieval(config, world_size=_world_for(path))
        # Round trip through plain data (what the run directory stores).
        assert config_from_dict(cls, to_dict(config)) == config


def test_defaults_are_the_embedded_demo() -> None:
    config = SFTConfig()
    validate_sft(config, world_size=2)
    assert config.model.path is None and config.data.path is None
    validate_retrieval(RetrievalConfig(), world_size=2)


def test_overrides_are_typed() -> None:
    config = load_config(
        SFTConfig,
        None,
        ["optim.lr=2e-5", "parallel.cp=2", "optim.betas=[0.8, 0.9]", "optim.max_grad_norm=null"],
    )
    assert config.optim.lr == pytest.approx(2e-5)
    assert config.parallel.cp == 2
    assert config.optim.betas == (0.8, 0.9)
    assert config.optim.max_grad_norm is None


@pytest.mark.parametrize(
    ("overrides", "world", "key"),
    [
        (["optim.learning_rate=1e-3"], 2, "optim.learning_rate"),
        (["bogus=1"], 2, "bogus"),
        (["parallel.ddp.static_grap=true"], 2, "parallel.ddp.static_grap"),
        (["optim.lr=fast"], 2, "optim.lr"),
        (["train.steps=1.5"], 2, "train.steps"),
        (["parallel.data_parallel=zero3"], 2, "parallel.data_parallel"),
        (["optim=3"], 2, "optim"),
        (
            ["parallel.ddp.static_graph=true", "train.gradient_accumulation_steps=2"],
            2,
            "parallel.ddp.static_graph",
        ),
        (["parallel.cp=2"], 3, "parallel.cp"),
        (["parallel.cp=0"], 2, "parallel.cp"),
        (["train.gradient_accumulation_steps=0"], 2, "train.gradient_accumulation_steps"),
        (["data.path=/nonexistent/energon"], 2, "data.path"),
        (["model.path=/nonexistent/model"], 2, "model.path"),
        (["model.tiny.num_heads=3"], 2, "model.tiny.num_heads"),
        (["parallel.cp=2", "data.packing=true"], 2, "data.packing"),
        (["parallel.tp=2"], 2, "parallel.tp"),
        (
            ["parallel.tp=2", "parallel.data_parallel=fsdp2", "model.tiny.num_kv_heads=1"],
            2,
            "model.tiny.num_kv_heads",
        ),
        (["parallel.tp=2", "parallel.cp=2"], 2, "parallel.tp"),
        (["data.demo=shapes"], 2, "data.model_family"),
        (["data.demo=shapes", "data.model_family=qwen2_5_vl", "parallel.cp=2"], 2, "parallel.cp"),
        (["data.num_logical_shards=3"], 2, "data.num_logical_shards"),
    ],
)
def test_bad_sft_config_names_the_key(overrides: list[str], world: int, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_sft(load_config(SFTConfig, None, overrides), world_size=world)
    assert info.value.key == key
    assert f"'{key}'" in str(info.value)


def test_bad_yaml_key_names_the_nested_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 10\n  optimizer_steps: 3\n")
    with pytest.raises(ConfigError, match=r"'train\.optimizer_steps'"):
        load_config(SFTConfig, path)


def test_bad_retrieval_config_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        validate_retrieval(
            load_config(RetrievalConfig, None, ["train.gradient_accumulation_steps=2"]),
            world_size=2,
        )
    assert info.value.key == "train.gradient_accumulation_steps"
    with pytest.raises(ConfigError) as info:
        validate_retrieval(
            load_config(RetrievalConfig, None, ["model.temperature=0"]), world_size=1
        )
    assert info.value.key == "model.temperature"
    with pytest.raises(ConfigError) as info:
        validate_retrieval(
            load_config(RetrievalConfig, None, ["parallel.data_parallel=fsdp2"]), world_size=1
        )
    assert info.value.key == "parallel.data_parallel"


def test_parallel_knobs_mirror_the_engine_configs() -> None:
    import dataclasses

    import torch

    from train_engine import DDPConfig, FSDP2Config
    from train_recipes._dist import engine_dp_config
    from train_recipes.config import DDPKnobs, FSDPKnobs, ParallelConfig

    def defaults(cls: type) -> dict[str, object]:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    # Same names and defaults: a knob added to the engine must be added here too.
    assert defaults(DDPKnobs) == defaults(DDPConfig)
    engine_fsdp = defaults(FSDP2Config)
    for name, default in defaults(FSDPKnobs).items():
        assert name in engine_fsdp, f"FSDPKnobs.{name} is not a train_engine.FSDP2Config field"
        assert default == engine_fsdp[name]
    ddp = engine_dp_config(ParallelConfig(ddp=DDPKnobs(static_graph=True, bucket_cap_mb=50.0)))
    assert ddp == DDPConfig(static_graph=True, bucket_cap_mb=50.0)
    fsdp = engine_dp_config(
        ParallelConfig(
            data_parallel="fsdp2",
            fsdp=FSDPKnobs(param_dtype="bfloat16", reduce_dtype="float32", cpu_offload=True),
        )
    )
    assert fsdp == FSDP2Config(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cpu_offload=True
    )


def test_cli_rejects_before_any_process_group(capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["sft", "--set", "optim.lr_peak=1"], "optim.lr_peak"),
        (["sft", "--nproc-per-node", "3", "--set", "parallel.cp=2"], "parallel.cp"),
        (["sft", "--set", "data.path=/nonexistent"], "data.path"),
        (["sft", "--set", "model.path=/nonexistent"], "model.path"),
        (
            [
                "sft",
                "--set",
                "parallel.ddp.static_graph=true",
                "--set",
                "train.gradient_accumulation_steps=4",
            ],
            "parallel.ddp.static_graph",
        ),
        (["retrieval", "--set", "data.source=web"], "data.source"),
    ]
    for argv, key in cases:
        assert main(argv) == 2, argv
        assert f"'{key}'" in capsys.readouterr().err
        assert not dist.is_initialized()
