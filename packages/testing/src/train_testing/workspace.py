"""Facts about the workspace read from its files: members, versions, pins, imports."""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

RECIPES_DIST = "train-recipes"
TESTING_DIST = "train-testing"


@dataclass(kw_only=True, slots=True, frozen=True)
class Member:
    """One workspace member.

    Attributes:
        folder: its folder under packages/.
        dist: distribution name.
        version: the static version in its pyproject.toml.
        import_name: the package under src/.
        dependencies: its runtime requirements, as written.
    """

    folder: Path
    dist: str
    version: str
    import_name: str
    dependencies: tuple[str, ...]


def load_members(root: Path) -> dict[str, Member]:
    """Read every packages/*/pyproject.toml under ``root``; key = distribution name."""
    members = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        with open(pyproject, "rb") as f:
            project = tomllib.load(f)["project"]
        (src_pkg,) = [p for p in (pyproject.parent / "src").iterdir() if p.is_dir()]
        members[project["name"]] = Member(
            folder=pyproject.parent,
            dist=project["name"],
            version=project["version"],
            import_name=src_pkg.name,
            dependencies=tuple(project.get("dependencies", [])),
        )
    return members


def library_members(members: dict[str, Member]) -> dict[str, Member]:
    """The published library packages: everything but the recipes and the test helper."""
    return {d: m for d, m in members.items() if d not in (RECIPES_DIST, TESTING_DIST)}


def recipe_pin_problems(root: Path) -> list[str]:
    """Every way recipes' pins disagree with the library members' versions (empty = consistent)."""
    members = load_members(root)
    libraries = library_members(members)
    pins = {}
    for line in members[RECIPES_DIST].dependencies:
        req = Requirement(line)
        if req.name in libraries:
            pins[req.name] = req
    problems = []
    for dist, member in sorted(libraries.items()):
        pin = pins.get(dist)
        if pin is None:
            problems.append(
                f"{RECIPES_DIST} does not depend on {dist}; add '{dist}=={member.version}'"
            )
            continue
        specs = list(pin.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            problems.append(
                f"{RECIPES_DIST} pins {dist} as '{pin.specifier}'; it must be '=={member.version}'"
            )
        elif specs[0].version != member.version:
            problems.append(
                f"{RECIPES_DIST} pins {dist}=={specs[0].version} but packages/{member.folder.name} is "
                f"version {member.version}; move the pin (and bump {RECIPES_DIST}, see RELEASING.md)"
            )
    return problems


def cross_imports(root: Path) -> list[str]:
    """Imports or dependencies of one library package on another (libraries must stand alone)."""
    libraries = library_members(load_members(root))
    names = {m.import_name: d for d, m in libraries.items()}
    problems = []
    for dist, member in sorted(libraries.items()):
        for line in member.dependencies:
            other = Requirement(line).name
            if other in libraries or other in (RECIPES_DIST, TESTING_DIST):
                problems.append(f"{dist} declares a dependency on workspace member {other}")
        own_roots = [member.folder / "src", member.folder / "bench"]
        for path in sorted(p for d in own_roots if d.exists() for p in d.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                # A bench script may use train_testing's shared bench helpers (the harness is
                # a development dependency, never shipped in a library's wheel); library
                # sources may not.
                in_bench = path.is_relative_to(member.folder / "bench")
                forbidden = ("train_recipes",) if in_bench else ("train_recipes", "train_testing")
                for module in modules:
                    top = module.split(".")[0]
                    if (top in names and names[top] != dist) or top in forbidden:
                        rel = path.relative_to(root)
                        problems.append(
                            f"{rel}:{node.lineno} imports {module} ({dist} must not import it)"
                        )
    return problems


def repeated_test_module_names(root: Path) -> list[str]:
    """Module basenames found in more than one member's ``tests/`` folder (empty = unique).

    Each ``tests/`` folder is imported by bare module names (the folders are not packages: all
    are called ``tests``), and spawned ranks re-import rank functions by module name, so a name
    used twice breaks a session that collects both packages.
    """
    folders: dict[str, list[str]] = {}
    for path in sorted((root / "packages").glob("*/tests/*.py")):
        if path.name != "conftest.py":
            folders.setdefault(path.stem, []).append(path.parent.parent.name)
    return [
        f"tests module {name}.py exists in {', '.join(owners)}; prefix it with the package or topic"
        for name, owners in sorted(folders.items())
        if len(owners) > 1
    ]
