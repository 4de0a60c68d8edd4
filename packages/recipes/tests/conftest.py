"""Shared fixtures: one small demo dataset for the session (generation + energon prepare once)."""

from __future__ import annotations

import pytest

from train_recipes.demo import DemoSplit, write_demo_dataset


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> DemoSplit:
    return write_demo_dataset(
        tmp_path_factory.mktemp("demo") / "data",
        task="addition",
        train_size=4000,
        eval_size=64,
        seed=0,
    )


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory: pytest.TempPathFactory) -> DemoSplit:
    return write_demo_dataset(
        tmp_path_factory.mktemp("shapes") / "data",
        task="shapes",
        train_size=400,
        eval_size=16,
        seed=0,
    )


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
