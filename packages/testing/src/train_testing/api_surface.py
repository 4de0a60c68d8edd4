"""Each published package's public API, recorded per release, and the check that a change bumps it.

`python -m train_testing.api_surface check` compares every published package's current public
surface with ``packages/<folder>/api/<version>.json``, the record of its current version, and
fails when they differ (the change needs a version bump and a CHANGELOG entry) or when the
CHANGELOG has no section for the version. `python -m train_testing.api_surface write` writes the
record of each package's current version; it refuses to rewrite a record that differs, since a
released version's surface does not change. ``release-check`` runs the check against the
installed wheels.

What a record holds, and which modules are public, is `train_testing.api_inspect`'s part: it
reads the surface; this module compares it with the records and the CHANGELOG.

SemVer for 0.x (as Cargo reads it): the minor version is the breaking one. A removed or changed
name needs at least the next minor version (0.1.3 -> 0.2.0), an added name the next patch
(0.1.3 -> 0.1.4); from 1.0 on, major and minor.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from train_testing.api_inspect import Entry, Surface, package_surface, public_modules
from train_testing.workspace import TESTING_DIST, Member, load_members

__all__ = [
    "SurfaceDiff",
    "check_member",
    "diff_surfaces",
    "package_surface",
    "public_modules",
    "record_path",
    "required_bump",
    "write_record",
]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class SurfaceDiff:
    """How a package's surface changed, each name written ``module.name``.

    Attributes:
        added: names only the new surface has.
        removed: names only the old surface has.
        changed: one line per changed name: what differs, old -> new.
    """

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def lines(self) -> list[str]:
        """Human-readable lines, one per added, removed or changed name."""
        return (
            [f"  added   {name}" for name in self.added]
            + [f"  removed {name}" for name in self.removed]
            + [f"  changed {line}" for line in self.changed]
        )


def diff_surfaces(old: Mapping[str, Mapping[str, Entry]], new: Surface) -> SurfaceDiff:
    """The names added, removed and changed from ``old`` to ``new`` (surfaces or records)."""
    flat_old = {f"{m}.{n}": e for m, names in old.items() for n, e in names.items()}
    flat_new = {f"{m}.{n}": e for m, names in new.items() for n, e in names.items()}
    changed = []
    for name in sorted(flat_old.keys() & flat_new.keys()):
        changed += [f"{name}{line}" for line in _entry_changes(flat_old[name], flat_new[name])]
    return SurfaceDiff(
        added=tuple(sorted(flat_new.keys() - flat_old.keys())),
        removed=tuple(sorted(flat_old.keys() - flat_new.keys())),
        changed=tuple(changed),
    )


def _entry_changes(old: object, new: object, path: str = "") -> list[str]:
    """Lines ``<path>: what changed``; a class's methods, fields and members read as its own."""
    if old == new:
        return []
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [f"{path}: {json.dumps(old)} -> {json.dumps(new)}"]
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if key in _MEMBER_TABLES:
            lines += _entry_changes(old.get(key, {}), new.get(key, {}), path)
        elif key not in new:
            lines.append(f"{path}.{key}: removed")
        elif key not in old:
            lines.append(f"{path}.{key}: added {json.dumps(new[key])}")
        else:
            lines += _entry_changes(old[key], new[key], f"{path}.{key}")
    return lines


_MEMBER_TABLES = frozenset({"attributes", "fields", "members"})


def required_bump(version: str, diff: SurfaceDiff) -> str | None:
    """The smallest version part to bump after ``diff`` (SemVer, 0.x read as Cargo does).

    Returns:
        ``"major"``, ``"minor"`` or ``"patch"``; None when the surface did not change.
    """
    if not diff:
        return None
    breaking = bool(diff.removed or diff.changed)
    if Version(version).major == 0:
        return "minor" if breaking else "patch"
    return "major" if breaking else "minor"


def _bumped(version: str, part: str) -> Version:
    v = Version(version)
    if part == "major":
        return Version(f"{v.major + 1}.0.0")
    if part == "minor":
        return Version(f"{v.major}.{v.minor + 1}.0")
    return Version(f"{v.major}.{v.minor}.{v.micro + 1}")


def record_path(member: Member, version: str | None = None) -> Path:
    """``packages/<folder>/api/<version>.json``: the surface of a released version."""
    return member.folder / "api" / f"{version or member.version}.json"


def _records(member: Member) -> dict[Version, Path]:
    return {Version(p.stem): p for p in sorted((member.folder / "api").glob("*.json"))}


def _load(path: Path) -> Surface:
    modules: Surface = json.loads(path.read_text(encoding="utf-8"))["modules"]
    return modules


def _render(member: Member, surface: Surface) -> str:
    record = {"distribution": member.dist, "version": member.version, "modules": surface}
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


WRITE_COMMAND = "uv run --all-packages python -m train_testing.api_surface write --package {dist}"


def _fix(member: Member, bump: str) -> str:
    return (
        f"bump the version (`uv version --package {member.dist} --bump {bump}`, see RELEASING.md), "
        f"add a '## <new version>' section to packages/{member.folder.name}/CHANGELOG.md, "
        f"then write the new version's record: `{WRITE_COMMAND.format(dist=member.dist)}`"
    )


def check_member(member: Member, surface: Surface) -> list[str]:
    """Every way ``member``'s current ``surface`` disagrees with its records and CHANGELOG.

    Returns:
        Problems, each saying what to do (empty = the record of the current version matches and
        the CHANGELOG has its section).
    """
    problems = _changelog_problems(member)
    current = record_path(member)
    rel = current.relative_to(member.folder.parent.parent)
    if current.exists():
        diff = diff_surfaces(_load(current), surface)
        if diff:
            bump = required_bump(member.version, diff)
            assert bump is not None
            problems.append(
                "\n".join(
                    [
                        f"{member.dist} {member.version}: the public API differs from {rel}, "
                        f"the record of the released {member.version}:",
                        *diff.lines(),
                        "A released version's API does not change (SemVer, 0.x: a removed or "
                        "changed name needs a minor bump, an added one a patch bump): "
                        + _fix(member, bump),
                    ]
                )
            )
        return problems
    earlier = [v for v in _records(member) if v < Version(member.version)]
    write = WRITE_COMMAND.format(dist=member.dist)
    if not earlier:
        return [*problems, f"{member.dist} {member.version} has no API record ({rel}): `{write}`"]
    base = max(earlier)
    diff = diff_surfaces(_load(_records(member)[base]), surface)
    bump = required_bump(str(base), diff)
    if bump is not None and Version(member.version) < _bumped(str(base), bump):
        problems.append(
            "\n".join(
                [
                    f"{member.dist}: the public API changed since {base} and needs at least "
                    f"{_bumped(str(base), bump)} (a {bump} bump), but the version is {member.version}:",
                    *diff.lines(),
                ]
            )
        )
    problems.append(f"{member.dist} {member.version} has no API record ({rel}): `{write}`")
    return problems


def _changelog_problems(member: Member) -> list[str]:
    changelog = member.folder / "CHANGELOG.md"
    heading = re.compile(rf"^## {re.escape(member.version)}(\s|$)", re.MULTILINE)
    if changelog.exists() and heading.search(changelog.read_text(encoding="utf-8")):
        return []
    return [
        f"packages/{member.folder.name}/CHANGELOG.md has no '## {member.version}' section for "
        f"{member.dist}'s current version; add one that says what changed"
    ]


def write_record(member: Member, surface: Surface, *, force: bool = False) -> Path:
    """Write ``member``'s current ``surface`` as the record of its current version.

    Raises:
        ValueError: a record of this version exists and differs (a released version's surface
            does not change: bump the version first); ``force`` overwrites it.
    """
    path = record_path(member)
    text = _render(member, surface)
    if path.exists() and path.read_text(encoding="utf-8") != text and not force:
        diff = diff_surfaces(_load(path), surface)
        raise ValueError(
            "\n".join(
                [
                    f"{path.name} of {member.dist} already records {member.version} and the API "
                    "differs from it:",
                    *diff.lines(),
                    "bump the version first (see RELEASING.md); --force rewrites a released "
                    "record (only for a version never published)",
                ]
            )
        )
    path.parent.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _published(root: Path, only: Sequence[str]) -> list[Member]:
    members = [m for d, m in sorted(load_members(root).items()) if d != TESTING_DIST]
    unknown = set(only) - {m.dist for m in members}
    if unknown:
        raise SystemExit(f"unknown distribution(s) {sorted(unknown)}; pick from the members")
    return [m for m in members if not only or m.dist in only]


def main(argv: Sequence[str]) -> int:
    """`check` or `write` the API records of the workspace's published packages; 1 on a problem."""
    parser = argparse.ArgumentParser(prog="python -m train_testing.api_surface")
    parser.add_argument("command", choices=["check", "write"])
    parser.add_argument("--root", type=Path, default=Path(), help="the workspace (default: .)")
    parser.add_argument("--package", action="append", default=[], help="a distribution name")
    parser.add_argument("--force", action="store_true", help="write: rewrite a differing record")
    args = parser.parse_args(argv)
    failed = False
    for member in _published(args.root.resolve(), args.package):
        surface = package_surface(member.import_name, dist=member.dist)
        if args.command == "write":
            try:
                logger.info("wrote %s", write_record(member, surface, force=args.force))
            except ValueError as e:
                logger.error("%s", e)
                failed = True
            continue
        problems = check_member(member, surface)
        for problem in problems:
            logger.error("%s", problem)
        if not problems:
            logger.info("%s %s: API matches its record", member.dist, member.version)
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="api-surface: %(message)s")
    sys.exit(main(sys.argv[1:]))
