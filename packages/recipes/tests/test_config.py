"""Config loading, overrides and validation: every bad config is rejected naming its key."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import SHIPPED_CONFIGS, model_and_data_stand_ins, shipped_world_size
from train_recipes.cli.config_commands import RECIPES, infer_recipe
from train_recipes.cli.main import main
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
from train_recipes.config.dpo import DPOConfig, validate_dpo
from train_recipes.config.grpo import GRPOConfig
from train_recipes.config.grpo_validation import validate_grpo


def test_every_shipped_config_loads_and_validates(tmp_path: Path) -> None:
    files = sorted(SHIPPED_CONFIGS.glob("*.yaml"))
    assert len(files) >= 5, files
    model, data = model_and_data_stand_ins(tmp_path)
    for path in files:
        cls = RECIPES[infer_recipe(path)]
        assert (cls is RetrievalConfig) == path.name.startswith("retrieval"), path.name
        config = load_config(cls, path)
        # Paths on a GPU cluster do not exist here: point them at stand-ins, validate the rest.
        overrides = []
        if getattr(config.model, "path", None) is not None:
            overrides.append(f"model.path={model}")
        if getattr(config.data, "path", None) is not None:
            overrides.append(f"data.path={data}")
        config = load_config(cls, path, overrides)
        world = shipped_world_size(path.name)
        if isinstance(config, SFTConfig):
            validate_sft(config, world_size=world)
        elif isinstance(config, DPOConfig):
            validate_dpo(config, world_size=world)
        elif isinstance(config, GRPOConfig):
            validate_grpo(config, world_size=world)
        else:
            validate_retrieval(config, world_size=world)
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
        (["parallel.tp=2"], 2, "parallel.tp"),
        (
            ["parallel.tp=2", "parallel.data_parallel=fsdp2", "model.tiny.num_kv_heads=1"],
            2,
            "model.tiny.num_kv_heads",
        ),
        (["parallel.tp=2", "parallel.cp=2"], 2, "parallel.tp"),
        (["data.demo=shapes"], 2, "data.model_family"),
        (["data.model_family=no_such_family"], 2, "data.model_family"),
        (["data.num_logical_shards=3"], 2, "data.num_logical_shards"),
        (["train.steps=0"], 2, "train.steps"),
        (["train.checkpoint_every=-1"], 2, "train.checkpoint_every"),
        (["data.micro_batch_size=0"], 2, "data.micro_batch_size"),
        (["data.max_length=1"], 2, "data.max_length"),
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


def test_parallel_sections_are_the_engine_configs() -> None:
    """No mirrored copy: the YAML sections load into train-engine's own config classes."""
    from train_engine import DDPConfig, FSDP2Config

    ddp = load_config(
        SFTConfig, None, ["parallel.ddp.static_graph=true", "parallel.ddp.bucket_cap_mb=50"]
    ).parallel
    assert type(ddp.ddp) is DDPConfig
    assert ddp.data_parallel_config() == DDPConfig(static_graph=True, bucket_cap_mb=50.0)
    fsdp = load_config(
        SFTConfig,
        None,
        [
            "parallel.data_parallel=fsdp2",
            "parallel.fsdp.param_dtype=bfloat16",
            "parallel.fsdp.reduce_dtype=float32",
            "parallel.fsdp.cpu_offload=true",
            "parallel.fsdp.reshard_after_forward=false",
        ],
    ).parallel
    assert fsdp.data_parallel_config() == FSDP2Config(
        param_dtype="bfloat16",
        reduce_dtype="float32",
        cpu_offload=True,
        reshard_after_forward=False,
    )
    with pytest.raises(ConfigError, match=r"parallel\.fsdp\.param_dtype"):
        load_config(SFTConfig, None, ["parallel.fsdp.param_dtype=fp8"])


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


def test_demo_cpu_yaml_is_the_embedded_default_written_out() -> None:
    # Its header says so: only the device is pinned (to the CPU), and the demo's 2 ranks
    # (launch.nproc_per_node unset means 2 without --config) are written out.
    written = load_config(SFTConfig, SHIPPED_CONFIGS / "demo-cpu.yaml")
    default = SFTConfig()
    assert written == dataclasses.replace(
        default,
        train=dataclasses.replace(default.train, device="cpu"),
        launch=dataclasses.replace(default.launch, nproc_per_node=2),
    )


# 17.8: values that used to be accepted and then failed late, oddly or silently.
BAD_SFT_VALUES = [
    ("optim.lr", "0"),
    ("optim.lr", "-1e-3"),
    ("optim.lr", ".nan"),
    ("optim.lr", ".inf"),
    ("optim.betas", "[1.0, 0.95]"),
    ("optim.betas", "[0.9, -0.1]"),
    ("optim.max_grad_norm", "0"),
    ("optim.max_grad_norm", "-1"),
    ("optim.weight_decay", "-0.1"),
    ("optim.eps", "-1e-8"),
    ("optim.eps", ".nan"),
    ("optim.warmup_steps", "-1"),
    ("optim.min_lr_ratio", "1.5"),
    ("model.tiny.num_heads", "0"),
    ("model.tiny.num_kv_heads", "0"),
    ("model.tiny.hidden_size", "0"),
    ("model.tiny.num_layers", "0"),
    ("model.tiny.intermediate_size", "0"),
    ("model.fused_loss_chunk_tokens", "0"),
    ("train.log_every", "0"),
    ("train.loss_window", "0"),
    ("train.keep_checkpoints", "-1"),
    ("train.eval_samples", "-1"),
    ("train.eval_max_new_tokens", "0"),
    ("train.peak_tflops", "0"),
    ("train.peak_tflops", ".inf"),
    ("train.output_dir", "''"),
    ("train.output_dir", "'  '"),
    ("data.num_workers", "-1"),
    ("data.num_logical_shards", "0"),
    ("data.demo_train_size", "0"),
    ("lora.r", "0"),
    ("lora.alpha", "0"),
    ("data.model_family", "llama"),
]


def _reported_key(key: str, value: str) -> str:
    # A list value is reported by its element, e.g. optim.betas[0].
    if key == "optim.betas":
        return "optim.betas[0]" if value.startswith("[1") else "optim.betas[1]"
    return key


@pytest.mark.parametrize(("key", "value"), BAD_SFT_VALUES)
def test_bad_sft_value_is_rejected_naming_the_key(key: str, value: str) -> None:
    config = load_config(SFTConfig, None, [f"{key}={value}"])
    with pytest.raises(ConfigError) as info:
        validate_sft(config, world_size=2)
    assert info.value.key == _reported_key(key, value), info.value


BAD_RETRIEVAL_VALUES = [
    ("optim.lr", "0"),
    ("optim.lr", ".nan"),
    ("optim.betas", "[0.9, 1.0]"),
    ("optim.max_grad_norm", "0"),
    ("model.temperature", "0"),
    ("model.temperature", ".nan"),
    ("train.steps", "0"),
    ("train.log_every", "0"),
    ("train.loss_window", "0"),
    ("train.output_dir", "''"),
    ("data.eval_size", "0"),
    ("data.micro_batch_size", "0"),
    ("data.max_length", "1"),
    ("data.modules", "[]"),
]


@pytest.mark.parametrize(("key", "value"), BAD_RETRIEVAL_VALUES)
def test_bad_retrieval_value_is_rejected_naming_the_key(key: str, value: str) -> None:
    config = load_config(RetrievalConfig, None, [f"{key}={value}"])
    with pytest.raises(ConfigError) as info:
        validate_retrieval(config, world_size=1)
    assert info.value.key == _reported_key(key, value), info.value


def test_boundary_values_are_accepted() -> None:
    # The edges of each range are legal: no clipping, no warm-up, keep every checkpoint.
    config = load_config(
        SFTConfig,
        None,
        [
            "optim.max_grad_norm=null",
            "optim.betas=[0.0, 0.999]",
            "optim.eps=0",
            "optim.warmup_steps=0",
            "optim.min_lr_ratio=1.0",
            "train.keep_checkpoints=0",
            "train.eval_samples=0",
            "data.num_workers=0",
            "train.log_every=1",
        ],
    )
    validate_sft(config, world_size=2)
    assert config.optim.max_grad_norm is None and math.isclose(config.optim.betas[1], 0.999)


def test_model_family_comes_from_energon_sfts_registry(tmp_path: Path) -> None:
    from energon_sft import known_model_families

    _, data = model_and_data_stand_ins(tmp_path)
    for family in known_model_families():
        overrides = [f"data.model_family={family}", f"data.path={data}"]
        validate_sft(load_config(SFTConfig, None, overrides), world_size=2)
    with pytest.raises(ConfigError, match=r"known: \['qwen2_5_vl'"):
        validate_sft(load_config(SFTConfig, None, ["data.model_family=gpt"]), world_size=2)


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["sft", "--set", "optim.lr=0"], "optim.lr"),
        (["sft", "--set", "model.tiny.num_heads=0"], "model.tiny.num_heads"),
        (["sft", "--set", "train.log_every=0"], "train.log_every"),
        (["sft", "--set", "lora.r=0"], "lora.r"),
        (["sft", "--set", "data.model_family=llama"], "data.model_family"),
        (["sft", "--output-dir", ""], "train.output_dir"),
        (["sft", "--nproc-per-node", "0"], "--nproc-per-node"),
        (["retrieval", "--set", "optim.betas=[0.9, 1.0]"], "optim.betas[1]"),
    ],
)
def test_cli_rejects_bad_values_in_one_line(
    argv: list[str], key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and err.count("\n") == 1, err
    assert not dist.is_initialized()


def test_missing_or_broken_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, tmp_path / "missing.yaml")
    assert info.value.key == "--config" and "missing.yaml" in str(info.value)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: {steps: 10\n")
    with pytest.raises(ConfigError, match=r"not valid YAML") as info:
        load_config(SFTConfig, broken)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"'optim\.betas'.*not valid YAML"):
        load_config(SFTConfig, None, ["optim.betas=[0.9,"])
