"""train_recipes' layout: subpackages only at the top, imports down the layers, no cycle."""

from pathlib import Path

import train_recipes
from train_testing.import_graph import assert_no_import_cycles, import_graph

# The top level holds subpackages, the package facade and the shipped configs only.
TOP_LEVEL_FILES = {"__init__.py", "py.typed"}


def test_modules_import_each_other_without_a_cycle() -> None:
    # Every import counts, function-local and TYPE_CHECKING ones too: they hide a cycle.
    assert_no_import_cycles("train_recipes")


def test_the_top_level_holds_only_subpackages() -> None:
    root = Path(train_recipes.__file__).parent
    files = {p.name for p in root.iterdir() if p.is_file()}
    assert files <= TOP_LEVEL_FILES, sorted(files - TOP_LEVEL_FILES)
    for folder in (p for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert folder.name == "configs" or (folder / "__init__.py").is_file(), folder.name


# Subpackage layers, top to bottom (ARCHITECTURE.md); a module imports its own layer or below.
LAYERS = {
    "cli": 5,
    "controller": 5,
    "sft": 4,
    "retrieval": 4,
    "grpo": 4,
    "dpo": 4,
    "loop": 3,
    "evaluation": 3,
    "export": 3,
    "model": 2,
    "loss": 2,
    "megatron": 2,
    "data": 1,
    "run": 1,
    "config": 0,
}
# The one module allowed to look up: config validation checks combined keys against what the
# model, data and schedule code supports, importing each lazily, before any rank starts.
LOOKS_UP = {"train_recipes.config.validation"}


def test_imports_go_down_the_layers() -> None:
    graph = import_graph("train_recipes")
    upward = []
    for source, edges in graph.items():
        here = _layer(source)
        for edge in edges:
            there = _layer(edge.target)
            if here is None or there is None or source in LOOKS_UP:
                continue
            if LAYERS[there] > LAYERS[here]:
                upward.append(edge.describe(source))
    assert not upward, "imports that go up a layer:\n" + "\n".join(sorted(upward))


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None
