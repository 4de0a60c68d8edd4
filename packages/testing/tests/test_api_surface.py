"""The API records: a change to a public name is found, and each committed record matches the code."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from train_testing.api_surface import (
    check_member,
    diff_surfaces,
    package_surface,
    public_modules,
    record_path,
    required_bump,
    write_record,
)
from train_testing.workspace import Member, load_members

ROOT = Path(__file__).resolve().parents[3]
PUBLISHED = ["cp-sharder", "energon-sft", "moe-dispatch", "train-engine", "train-recipes", "vocab-parallel"]  # fmt: skip

FACADE = """
from dataclasses import dataclass, field

from {name}.tools import scale

LIMIT = 4


@dataclass(kw_only=True, slots=True, frozen=True)
class Options:
    size: int = 2
    tags: list[str] = field(default_factory=list)


class Box:
    def __init__(self, options: Options) -> None:
        self.options = options

    def open(self, *, force: bool = False) -> int:
        return 0

    def _hidden(self) -> None:
        pass


def load(path: str, *, strict: bool = True) -> Box:
    return Box(Options())


__all__ = ["LIMIT", "Box", "Options", "load", "scale"]
"""
TOOLS = """
def scale(x: float, factor: float = 2.0) -> float:
    return x * factor


__all__ = ["scale"]
"""
# Neither is public: a private module, and a module without __all__.
PRIVATE = "__all__ = ['secret']\nsecret = 1\n"
PLAIN = "def helper() -> None: ...\n"

_names = itertools.count()


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A fresh importable package (its name, its folder), forgotten by the import system after."""
    name = f"fake_api_pkg_{os.getpid()}_{next(_names)}"
    src = tmp_path / "src"
    (src / name).mkdir(parents=True)
    _write(src / name, facade=FACADE.format(name=name), tools=TOOLS)
    (src / name / "_private.py").write_text(PRIVATE)
    (src / name / "plain.py").write_text(PLAIN)
    monkeypatch.syspath_prepend(str(src))
    yield name, src / name
    _forget(name)


def _write(pkg: Path, *, facade: str, tools: str) -> None:
    (pkg / "__init__.py").write_text(textwrap.dedent(facade))
    (pkg / "tools.py").write_text(textwrap.dedent(tools))


def _forget(name: str) -> None:
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]
    importlib.invalidate_caches()


def _surface_after(name: str, pkg: Path, *, facade: str = FACADE, tools: str = TOOLS) -> dict:
    """The package's surface after its sources are rewritten."""
    _forget(name)
    _write(pkg, facade=facade.format(name=name), tools=tools)
    return package_surface(name)


def test_public_modules_are_the_facade_and_public_modules_with_all(fake: tuple[str, Path]) -> None:
    name, _ = fake
    assert public_modules(name) == [name, f"{name}.tools"]


def test_surface_records_signatures_fields_and_methods(fake: tuple[str, Path]) -> None:
    name, _ = fake
    surface = package_surface(name)
    facade = surface[name]
    assert facade["load"] == {"kind": "function", "signature": "(path: str, *, strict: bool = True) -> Box"}  # fmt: skip
    assert facade["LIMIT"] == {"kind": "constant", "value": "4"}
    assert facade["Options"]["fields"] == {"size": "int = 2", "tags": "list[str] = factory list"}
    assert facade["Box"]["signature"] == "(options: Options) -> None"
    assert facade["Box"]["attributes"] == {"open": "(self, *, force: bool = False) -> int"}
    assert surface[f"{name}.tools"]["scale"]["signature"] == (
        "(x: float, factor: float = 2.0) -> float"
    )
    # Deterministic: the same code gives the same JSON.
    again = _surface_after(name, fake[1])
    assert json.dumps(again, sort_keys=True) == json.dumps(surface, sort_keys=True)


def test_an_added_name_needs_a_patch_bump(fake: tuple[str, Path]) -> None:
    name, pkg = fake
    before = package_surface(name)
    facade = FACADE.replace('"scale"]', '"scale", "unload"]') + "\ndef unload() -> None: ...\n"
    diff = diff_surfaces(before, _surface_after(name, pkg, facade=facade))
    assert diff.added == (f"{name}.unload",)
    assert not diff.removed and not diff.changed
    assert required_bump("0.1.0", diff) == "patch"
    assert required_bump("1.2.0", diff) == "minor"


def test_a_removed_name_needs_a_minor_bump(fake: tuple[str, Path]) -> None:
    name, pkg = fake
    before = package_surface(name)
    diff = diff_surfaces(before, _surface_after(name, pkg, facade=FACADE.replace('"LIMIT", ', "")))
    assert diff.removed == (f"{name}.LIMIT",)
    assert not diff.added and not diff.changed
    assert required_bump("0.1.0", diff) == "minor"
    assert required_bump("1.2.0", diff) == "major"


@pytest.mark.parametrize(
    ("old", "new", "line"),
    [
        ("strict: bool = True", "strict: bool = False", ".load.signature: "),  # a default
        ("force: bool = False", "force: int = 0", ".Box.open: "),  # a method's signature
        ("size: int = 2", "count: int = 2", ".Options.size: removed"),  # a dataclass field
    ],
)
def test_a_changed_signature_needs_a_minor_bump(
    fake: tuple[str, Path], old: str, new: str, line: str
) -> None:
    name, pkg = fake
    before = package_surface(name)
    diff = diff_surfaces(before, _surface_after(name, pkg, facade=FACADE.replace(old, new)))
    assert not diff.added and not diff.removed
    assert any(change.startswith(f"{name}{line}") for change in diff.changed), diff.changed
    assert required_bump("0.3.1", diff) == "minor"


def test_moving_methods_into_a_private_base_changes_nothing(fake: tuple[str, Path]) -> None:
    name, pkg = fake
    before = package_surface(name)
    split = FACADE.replace(
        "class Box:\n    def __init__",
        "class _BoxBase:\n    def open(self, *, force: bool = False) -> int:\n        return 0\n\n\n"
        "class Box(_BoxBase):\n    def __init__",
    ).replace(
        "    def open(self, *, force: bool = False) -> int:\n        return 0\n\n    def _hidden",
        "    def _hidden",
    )
    after = _surface_after(name, pkg, facade=split)
    assert "class _BoxBase" in split and split.count("def open") == 1
    assert not diff_surfaces(before, after)


def test_a_change_in_a_public_submodule_is_found(fake: tuple[str, Path]) -> None:
    name, pkg = fake
    before = package_surface(name)
    after = _surface_after(name, pkg, tools=TOOLS.replace("factor: float = 2.0", "factor: float"))
    diff = diff_surfaces(before, after)
    # The facade re-exports it: both places name it.
    assert [c.split(":")[0] for c in diff.changed] == [
        f"{name}.scale.signature",
        f"{name}.tools.scale.signature",
    ]


def _member(name: str, pkg: Path, version: str, *, changelog: str | None = None) -> Member:
    folder = pkg.parent.parent / "packages" / "fake"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "CHANGELOG.md").write_text(changelog or f"# Changelog\n\n## {version} (unreleased)\n")
    return Member(folder=folder, dist="fake-api", version=version, import_name=name, dependencies=())  # fmt: skip


def test_check_passes_on_the_record_and_fails_on_a_change_without_a_bump(
    fake: tuple[str, Path],
) -> None:
    name, pkg = fake
    member = _member(name, pkg, "0.1.0")
    assert check_member(member, package_surface(name)) == [
        "fake-api 0.1.0 has no API record (packages/fake/api/0.1.0.json): "
        "`uv run --all-packages python -m train_testing.api_surface write --package fake-api`"
    ]
    write_record(member, package_surface(name))
    assert check_member(member, package_surface(name)) == []

    changed = _surface_after(name, pkg, facade=FACADE.replace('"LIMIT", ', ""))
    (problem,) = check_member(member, changed)
    assert problem.startswith("fake-api 0.1.0: the public API differs from packages/fake/api/0.1.0.json")  # fmt: skip
    assert f"removed {name}.LIMIT" in problem
    assert "--bump minor" in problem and "CHANGELOG.md" in problem
    assert "python -m train_testing.api_surface write --package fake-api" in problem
    # The released record is not rewritten in place.
    with pytest.raises(ValueError, match="bump the version first"):
        write_record(member, changed)

    # A patch bump is not enough for a removed name; a minor bump with its record is.
    patch = _member(name, pkg, "0.1.1")
    problems = check_member(patch, changed)
    assert "needs at least 0.2.0 (a minor bump), but the version is 0.1.1" in problems[0]
    minor = _member(name, pkg, "0.2.0")
    write_record(minor, changed)
    assert check_member(minor, changed) == []
    assert json.loads(record_path(minor).read_text())["version"] == "0.2.0"


def test_check_wants_a_changelog_section_for_the_version(fake: tuple[str, Path]) -> None:
    name, pkg = fake
    member = _member(name, pkg, "0.2.0", changelog="# Changelog\n\n## 0.1.0\n")
    write_record(member, package_surface(name))
    (problem,) = check_member(member, package_surface(name))
    assert "CHANGELOG.md has no '## 0.2.0' section" in problem


def test_the_command_fails_with_the_changed_names(fake: tuple[str, Path], tmp_path: Path) -> None:
    name, pkg = fake
    member = _member(name, pkg, "0.1.0")
    (member.folder / "pyproject.toml").write_text(
        '[project]\nname = "fake-api"\nversion = "0.1.0"\n'
    )
    (member.folder / "src").symlink_to(pkg.parent, target_is_directory=True)
    write_record(member, package_surface(name))
    (pkg / "tools.py").write_text(TOOLS.replace("factor: float = 2.0", "factor: float"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkg.parent), *sys.path])}
    command = [sys.executable, "-m", "train_testing.api_surface", "check", "--root", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 1, result.stderr
    assert f"changed {name}.tools.scale.signature" in result.stderr


@pytest.mark.skipif(
    not (ROOT / "packages" / "recipes" / "pyproject.toml").exists(),
    reason="needs the workspace checkout",
)
@pytest.mark.parametrize("dist", PUBLISHED)
def test_committed_record_matches_the_code(dist: str) -> None:
    """A public API change without a version bump, a record and a CHANGELOG entry fails here."""
    member = load_members(ROOT)[dist]
    if importlib.util.find_spec(member.import_name) is None:
        pytest.skip(f"{dist} is not installed here; `uvx nox -s release-check` checks its wheel")
    assert record_path(member).exists(), f"{dist} {member.version} has no API record"
    problems = check_member(member, package_surface(member.import_name, dist=dist))
    assert not problems, "\n".join(problems)
