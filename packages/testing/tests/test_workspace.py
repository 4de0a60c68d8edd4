"""The workspace rules hold for this repository, and the checks catch a violation."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from train_testing.readme_examples import python_blocks, unmarked_blocks
from train_testing.workspace import (
    cross_imports,
    load_members,
    recipe_pin_problems,
    repeated_test_module_names,
)

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    not (ROOT / "packages" / "recipes" / "pyproject.toml").exists(),
    reason="needs the workspace checkout",
)


def _copy_workspace(tmp_path: Path) -> Path:
    """A copy of the members' pyproject files and sources, safe to break."""
    for member in load_members(ROOT).values():
        dest = tmp_path / "packages" / member.folder.name
        shutil.copytree(member.folder / "src", dest / "src")
        shutil.copy(member.folder / "pyproject.toml", dest / "pyproject.toml")
    return tmp_path


def test_every_published_member_is_laid_out_as_agreed() -> None:
    members = load_members(ROOT)
    assert set(members) == {
        "train-engine",
        "cp-sharder",
        "moe-dispatch",
        "vocab-parallel",
        "energon-sft",
        "train-recipes",
        "train-testing",
    }
    for dist, member in members.items():
        if dist == "train-testing":
            continue
        for name in ("README.md", "CHANGELOG.md", "pyproject.toml"):
            assert (member.folder / name).is_file(), f"{dist} lacks {name}"
        assert (member.folder / "src" / member.import_name / "py.typed").is_file(), (
            f"{dist} lacks py.typed"
        )
        assert (member.folder / "tests").is_dir(), f"{dist} lacks tests/"
        assert member.import_name == dist.replace("-", "_") or dist.startswith("train-")


def test_recipes_pins_match_member_versions() -> None:
    assert recipe_pin_problems(ROOT) == []


def test_no_library_imports_another() -> None:
    assert cross_imports(ROOT) == []


def test_wrong_pin_is_reported(tmp_path: Path) -> None:
    root = _copy_workspace(tmp_path)
    recipes = root / "packages" / "recipes" / "pyproject.toml"
    text = recipes.read_text()
    version = load_members(ROOT)["cp-sharder"].version
    recipes.write_text(text.replace(f'"cp-sharder=={version}"', '"cp-sharder==9.9.9"'))
    problems = recipe_pin_problems(root)
    assert len(problems) == 1
    assert "cp-sharder==9.9.9" in problems[0]
    assert f"version {version}" in problems[0]
    recipes.write_text(text.replace(f'"cp-sharder=={version}"', '"cp-sharder>=0.1"'))
    assert "must be" in recipe_pin_problems(root)[0]


def test_release_check_command_fails_on_a_wrong_pin(tmp_path: Path) -> None:
    root = _copy_workspace(tmp_path)
    ok = subprocess.run(
        [sys.executable, "-m", "train_testing.release", str(root)], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    recipes = root / "packages" / "recipes" / "pyproject.toml"
    version = load_members(ROOT)["vocab-parallel"].version
    recipes.write_text(
        recipes.read_text().replace(f'"vocab-parallel=={version}"', '"vocab-parallel==0.0.1"')
    )
    bad = subprocess.run(
        [sys.executable, "-m", "train_testing.release", str(root)], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert "vocab-parallel==0.0.1" in bad.stderr


def test_cross_import_is_reported(tmp_path: Path) -> None:
    root = _copy_workspace(tmp_path)
    init = root / "packages" / "cp-sharder" / "src" / "cp_sharder" / "__init__.py"
    init.write_text(init.read_text() + "\nfrom vocab_parallel import token_log_probs\n")
    problems = cross_imports(root)
    assert len(problems) == 1
    assert "imports vocab_parallel" in problems[0]


def test_test_module_names_are_unique_across_packages(tmp_path: Path) -> None:
    assert repeated_test_module_names(ROOT) == []
    for member in ("alpha", "beta"):
        (tmp_path / "packages" / member / "tests").mkdir(parents=True)
        (tmp_path / "packages" / member / "tests" / "_workers.py").write_text("")
        (tmp_path / "packages" / member / "tests" / "conftest.py").write_text("")
    assert repeated_test_module_names(tmp_path) == [
        "tests module _workers.py exists in alpha, beta; prefix it with the package or topic"
    ]


def _readmes_and_their_tests() -> list[tuple[Path, Path]]:
    """Each README and the tests folder whose suite must run its examples (root: testing's)."""
    pairs = [(ROOT / "README.md", ROOT / "packages" / "testing" / "tests")]
    for member in load_members(ROOT).values():
        pairs.append((member.folder / "README.md", member.folder / "tests"))
    return [(readme, tests) for readme, tests in pairs if readme.is_file()]


def test_every_readme_python_block_is_run_or_marked_a_fragment() -> None:
    unmarked = [
        where for readme, _ in _readmes_and_their_tests() for where in unmarked_blocks(readme)
    ]
    assert unmarked == [], (
        "mark each ```python block `python run` (part of the README's example script, which the "
        "package's tests run; see train_testing.readme_examples) or `python fragment` (not run; "
        f"say in the prose what it needs): {unmarked}"
    )


def test_every_readme_with_examples_has_a_test_that_runs_them() -> None:
    for readme, tests in _readmes_and_their_tests():
        if not any(block.runs for block in python_blocks(readme)):
            continue
        # A test runs them itself or subclasses ReadmeChecks (train_testing.package_checks).
        runners = [
            t
            for t in tests.glob("test_*.py")
            if "run_readme_examples(" in t.read_text() or "(ReadmeChecks)" in t.read_text()
        ]
        assert runners, f"{readme} has ```python run blocks but no test in {tests} runs them"
