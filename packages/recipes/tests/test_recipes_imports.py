"""train_recipes' layout: subpackages only at the top, and no import cycle between its modules."""

from pathlib import Path

import train_recipes
from train_testing.import_graph import assert_no_import_cycles

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
