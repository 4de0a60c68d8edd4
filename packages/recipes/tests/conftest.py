"""Shared fixtures: small demo datasets for the session (generation + energon prepare once)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest
import torch

from _runs import TinyRun
from train_recipes.data.demo import DemoSplit, write_demo_dataset

# A short CPU run that logs every step and spends nothing on checkpoints, held-out evaluation or
# TensorBoard: the tests of training behaviour add their own steps, parallelism and export.
QUIET_CPU_RUN = (
    "train.log_every=1",
    "train.checkpoint_every=0",
    "train.eval_samples=0",
    "train.tensorboard=false",
    "train.device=cpu",
)


# The `train-recipes` CLI in a fresh process (as the console script runs it).
CLI = [sys.executable, "-m", "train_recipes.cli"]


def cli_env() -> dict[str, str]:
    """This process's environment for a CLI run: one OpenMP thread per rank and gloo on the
    loopback interface, unless the environment sets them."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


# Output a successful run must not print (issue 42 item 7): a traceback, nanobind's leak report
# at a rank's exit, Energon's packing-buffer bar, transformers' weights bar and LOAD REPORT.
NOISE = (
    "Traceback",
    "nanobind: leaked",
    "Filling reading buffer",
    "Loading weights",
    "LOAD REPORT",
)


def assert_quiet(output: str) -> None:
    """``output`` (a run's stdout and stderr) holds none of :data:`NOISE`."""
    found = [noise for noise in NOISE if noise in output]
    assert not found, (found, output[-4000:])


def sft_args(
    out: Path, sets: Iterable[str], *, nproc: int = 1, flags: Sequence[str] = ()
) -> list[str]:
    """The arguments of ``train-recipes sft`` on ``nproc`` ranks into ``out``: ``flags``, then
    one ``--set`` per override."""
    args = ["sft", "--nproc-per-node", str(nproc), "--output-dir", str(out), *flags]
    for item in sets:
        args += ["--set", item]
    return args


# The configs as installed (package data): the same files in a clone and in the wheel.
SHIPPED_CONFIGS = Path(str(files("train_recipes") / "configs"))


def shipped_world_size(name: str) -> int:
    """The world size a shipped config is written for: its ``launch.nproc_per_node``."""
    import yaml

    return int(yaml.safe_load((SHIPPED_CONFIGS / name).read_text())["launch"]["nproc_per_node"])


def model_and_data_stand_ins(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder holding only a Llama config.json and a chat template, and a prepared
    Energon folder of no shard (an index of nothing): enough for the config checks that look at
    the paths, nothing that loads."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": 4096})
    )
    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    data = tmp_path / "data"
    (data / ".nv-meta").mkdir(parents=True)
    (data / ".nv-meta" / ".info.json").write_text(json.dumps({"shard_counts": {}}))
    return model, data


def _demo(factory: pytest.TempPathFactory, task: str, train_size: int, eval_size: int) -> DemoSplit:
    folder = factory.mktemp(task) / "data"
    return write_demo_dataset(folder, task=task, train_size=train_size, eval_size=eval_size, seed=0)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> DemoSplit:
    return _demo(tmp_path_factory, "addition", train_size=4000, eval_size=64)


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory: pytest.TempPathFactory) -> DemoSplit:
    return _demo(tmp_path_factory, "shapes", train_size=400, eval_size=16)


@pytest.fixture(scope="session")
def epoch_data(tmp_path_factory: pytest.TempPathFactory) -> DemoSplit:
    """96 training chats: one epoch is 12 batches of 8 (6 steps at dp=2)."""
    return write_demo_dataset(
        tmp_path_factory.mktemp("epoch") / "data",
        task="addition",
        train_size=96,
        eval_size=8,
        seed=0,
    )


def data_overrides(split: DemoSplit) -> list[str]:
    return [f"data.path={split.energon_dir}", f"data.eval_path={split.eval_jsonl}"]


def unshuffled_cpu_run(
    split: DemoSplit, out: Path, steps: int, *, checkpoint_every: int = 0
) -> TinyRun:
    """A CPU run on ``split`` into ``out`` that logs every step, neither evaluates nor exports,
    and reads unshuffled micro-batches of 8 from 2 logical shards (so the samples each step
    sees are known): the data-plane, scale and Ray tests add their parallelism."""
    return TinyRun(
        data=split,
        out=out,
        steps=steps,
        checkpoint_every=checkpoint_every,
        export=False,
        micro_batch_size=8,
        logical_shards=2,
        shuffle=False,
    )


def merged_lora_run(split: DemoSplit, out: Path, steps: int) -> TinyRun:
    """A quiet CPU LoRA run on ``split`` into ``out`` (learning rate 1e-2, micro-batches of 8)
    that exports the merged model: the LoRA tests add their rank and parallelism."""
    return TinyRun(
        data=split,
        out=out,
        steps=steps,
        lr=1e-2,
        micro_batch_size=8,
        extra=("lora.enabled=true", "lora.export=merged"),
    )


def check_lora_run(
    run: dict[str, Any], adapter_dir: Path, probe: list[list[int]], *, window: int
) -> None:
    """A LoRA run's rank-0 report shows training (the last ``window`` logged losses sum below
    the first ``window``), no changed base weight, only ``lora_`` weights trainable, and both
    exports reproducing its logits on ``probe`` (:func:`check_lora_exports`)."""
    losses = [run["losses"][s] for s in sorted(run["losses"])]
    assert sum(losses[-window:]) < sum(losses[:window]), losses
    assert run["frozen_equal"], "a base weight changed under LoRA"
    assert run["trainable"] and all("lora_" in n for n in run["trainable"]), run["trainable"]
    check_lora_exports(run, adapter_dir, probe)


def check_lora_exports(run: dict[str, Any], adapter_dir: Path, probe: list[list[int]]) -> None:
    """Both exports of a LoRA run on the default tiny model reproduce its trained logits on
    ``probe``: the merged model (no ``lora_`` weights left), and the adapter alone loaded with
    peft onto the seeded base model rebuilt from the default config."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from train_recipes.config import SFTConfig, load_config
    from train_recipes.data.demo import build_char_tokenizer
    from train_recipes.model.build import build_model

    merged = AutoModelForCausalLM.from_pretrained(run["export_dir"]).eval()
    assert not any("lora_" in k for k in merged.state_dict())
    torch.manual_seed(0)
    base = build_model(load_config(SFTConfig, None, []), build_char_tokenizer())
    adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        for model in (merged, adapted):
            torch.testing.assert_close(
                model(input_ids=torch.tensor(probe)).logits, run["logits"], rtol=1e-4, atol=1e-4
            )
