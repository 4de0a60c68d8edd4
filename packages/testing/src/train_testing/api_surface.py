"""Each published package's public API, recorded per release, and the check that a change bumps it.

`python -m train_testing.api_surface check` compares every published package's current public
surface with ``packages/<folder>/api/<version>.json``, the record of its current version, and
fails when they differ (the change needs a version bump and a CHANGELOG entry) or when the
CHANGELOG has no section for the version. `python -m train_testing.api_surface write` writes the
record of each package's current version; it refuses to rewrite a record that differs, since a
released version's surface does not change. ``release-check`` runs the check against the
installed wheels.

Public modules: the package itself (its facade) and every submodule that defines ``__all__``
and has no part of its dotted name starting with ``_``; train-recipes counts only its facade and
``train_recipes.config`` (an application: its API is the CLI and the config schema, and its
modules are internal organisation). Modules are found in the source files, so one that needs an
optional dependency (and defines no ``__all__``) is never imported.

What a name's record holds (``__version__`` is left out: its value is the version):
  - a function: its ``inspect.signature`` as text;
  - a class: its direct bases (a private base of the package replaced by its own bases), its
    call signature when it defines ``__init__`` or ``__new__`` (none for a Protocol or an
    Enum), a dataclass's fields (``type = default``), an Enum's members, and each method,
    property and class attribute not starting with ``_`` (and ``__call__``, ``__iter__``, ...)
    that the package's own classes in its MRO define (``torch.nn.Module``'s own methods are
    torch's API, not ours);
  - a constant: its repr when it is a plain value, else its type; a type alias: its repr; a
    submodule: ``module``.
Annotations are written as in the source (every module has postponed annotations) or, for an
evaluated one, without module paths, so moving a class between modules changes nothing;
memory addresses are dropped from default values' reprs.

SemVer for 0.x (as Cargo reads it): the minor version is the breaking one. A removed or changed
name needs at least the next minor version (0.1.3 -> 0.2.0), an added name the next patch
(0.1.3 -> 0.1.4); from 1.0 on, major and minor.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import importlib.util
import inspect
import json
import logging
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import cast

from packaging.version import Version

from train_testing.workspace import RECIPES_DIST, TESTING_DIST, Member, load_members

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

# An entry of a surface: name -> description, nested (a class's methods, fields, members).
Entry = dict[str, object]
Surface = dict[str, dict[str, Entry]]  # module -> name -> entry

# Packages whose public modules are named rather than found (see the module docstring).
PUBLIC_MODULES: dict[str, tuple[str, ...]] = {
    RECIPES_DIST: ("train_recipes", "train_recipes.config"),
}
# Dunder methods that are API: they make an instance callable, iterable or a context manager.
PUBLIC_DUNDERS = frozenset(
    {"__call__", "__enter__", "__exit__", "__iter__", "__len__", "__getitem__"}
)
PLAIN_VALUES = (str, int, float, bool, type(None), bytes)
# Where type aliases' objects come from: `Literal[...]`, `dict[str, int]`, `Callable[..., T]`.
ALIAS_MODULES = frozenset({"typing", "typing_extensions", "types", "collections.abc"})
# "<function f at 0x7f...>" -> "<function f>": addresses differ on every run.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# "torch.nn.Module" -> "Module" in an evaluated annotation (source annotations are kept as written).
_MODULE_PATH = re.compile(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*)")


def public_modules(package: str, *, dist: str | None = None) -> list[str]:
    """The public modules of an importable ``package``, found without importing them.

    Args:
        package: the top-level import name, e.g. ``"cp_sharder"``.
        dist: its distribution name; a distribution in ``PUBLIC_MODULES`` gets the modules named
            there.

    Returns:
        Sorted dotted names: ``package`` and each submodule whose dotted name has no part
        starting with ``_`` and whose source assigns ``__all__``.

    Raises:
        ModuleNotFoundError: ``package`` is not importable here.
    """
    if dist in PUBLIC_MODULES:
        return sorted(PUBLIC_MODULES[dist])
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{package} is not an importable package here", name=package)
    modules = {package}
    for location in spec.submodule_search_locations:
        root = Path(location)
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            if any(part.startswith("_") for part in parts[1:]):
                continue
            if _assigns_all(path):
                modules.add(".".join(parts))
    return sorted(modules)


def _assigns_all(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign | ast.AugAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def package_surface(package: str, *, dist: str | None = None) -> Surface:
    """The public surface of ``package``: for each public module, its ``__all__`` described.

    Imports the package and its public modules.

    Returns:
        ``{module: {name: entry}}``, JSON-ready; entries are described in the module docstring.

    Raises:
        ImportError: a public module does not import here.
        AttributeError: a module's ``__all__`` names something the module lacks.
    """
    root = package.split(".")[0]
    surface: Surface = {}
    for name in public_modules(package, dist=dist):
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        if exported is None:
            raise AttributeError(f"{name} is a public module but defines no __all__")
        surface[name] = {
            item: _describe(getattr(module, item), root)
            for item in sorted(exported)
            if item != "__version__"  # its value is the version itself
        }
    return surface


def _describe(obj: object, root: str) -> Entry:
    if isinstance(obj, ModuleType):
        return {"kind": "module"}
    if type(obj).__module__ in ALIAS_MODULES:  # before callable(): Callable[...] is callable
        return {"kind": "alias", "value": _MODULE_PATH.sub("", _repr(obj))}
    if isinstance(obj, type):
        return _describe_class(obj, root)
    if callable(obj):
        return {"kind": "function", "signature": _signature(obj)}
    if isinstance(obj, PLAIN_VALUES) or _is_plain_collection(obj):
        return {"kind": "constant", "value": _repr(obj)}
    return {"kind": "object", "type": type(obj).__qualname__}


def _is_plain_collection(obj: object) -> bool:
    if isinstance(obj, tuple | frozenset | list | set):
        return all(isinstance(x, PLAIN_VALUES) for x in obj)
    if isinstance(obj, dict):
        return all(isinstance(x, PLAIN_VALUES) for x in (*obj, *obj.values()))
    return False


def _describe_class(cls: type, root: str) -> Entry:
    entry: Entry = {"kind": "class", "bases": _public_bases(cls, root)}
    own = [k for k in reversed(cls.__mro__) if k.__module__.split(".")[0] == root]
    defines_call = any(name in vars(k) for k in own for name in ("__init__", "__new__"))
    # A Protocol's and an Enum's call signatures are the typing and enum modules' (and change
    # with the Python version); an Enum's members are recorded instead.
    is_enum = issubclass(cls, enum.Enum)
    if defines_call and not is_enum and not getattr(cls, "_is_protocol", False):
        entry["signature"] = _signature(cls)
    fields: dict[str, str] = {}
    if dataclasses.is_dataclass(cls):
        fields = {f.name: _field(f) for f in dataclasses.fields(cls)}
        entry["fields"] = fields
    if is_enum:
        entry["members"] = {m.name: _repr(m.value) for m in cast(type[enum.Enum], cls)}
    attributes: dict[str, str] = {}
    for klass in own:  # base first, so a subclass's definition wins
        for name, value in vars(klass).items():
            public = not name.startswith("_") or name in PUBLIC_DUNDERS
            # An Enum's members are its own instances, recorded above.
            if public and name not in fields and not isinstance(value, cls):
                attributes[name] = _attribute(value)
    entry["attributes"] = dict(sorted(attributes.items()))
    return entry


def _public_bases(cls: type, root: str) -> list[str]:
    """Direct bases, a private base of the package replaced by its own bases.

    Moving methods into a private base class (``Engine(_EngineState)``) changes no API: the
    methods are still recorded (the MRO's own classes) and the public bases stay the same.
    """
    bases: list[str] = []
    for base in cls.__bases__:
        parts = base.__module__.split(".")
        private = parts[0] == root and any(p.startswith("_") for p in [*parts[1:], base.__name__])
        for name in _public_bases(base, root) if private else [base.__qualname__]:
            if name not in bases:
                bases.append(name)
    return bases


def _attribute(value: object) -> str:
    if isinstance(value, staticmethod | classmethod):
        return f"{type(value).__name__} {_signature(value.__func__)}"
    if isinstance(value, property):
        return "property" if value.fset is None else "property (settable)"
    if type(value).__name__ == "cached_property":
        return "property (cached)"
    if isinstance(value, type):
        return f"class {value.__qualname__}"
    if callable(value):
        return _signature(value)
    if isinstance(value, PLAIN_VALUES) or _is_plain_collection(value):
        return _repr(value)
    if type(value).__name__ == "member_descriptor":
        return "attribute (slot)"
    return f"attribute: {type(value).__qualname__}"


def _field(field: dataclasses.Field[object]) -> str:
    text = _annotation(field.type)
    if field.default is not dataclasses.MISSING:
        text += f" = {_repr(field.default)}"
    elif field.default_factory is not dataclasses.MISSING:
        factory = field.default_factory
        text += f" = factory {getattr(factory, '__qualname__', _repr(factory))}"
    if not field.init:
        text += " (not in __init__)"
    return text


class _Text:
    """Renders as its text inside ``str(inspect.Signature)`` (which reprs annotations, defaults)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj: Callable[..., object]) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without text signature
        return "(...)"
    empty = inspect.Parameter.empty
    params = [
        p.replace(
            annotation=empty if p.annotation is empty else _Text(_annotation(p.annotation)),
            default=empty if p.default is empty else _Text(_repr(p.default)),
        )
        for p in sig.parameters.values()
    ]
    ret = sig.return_annotation
    return str(
        sig.replace(
            parameters=params,
            return_annotation=inspect.Signature.empty if ret is empty else _Text(_annotation(ret)),
        )
    )


def _annotation(annotation: object) -> str:
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__qualname__
    return _MODULE_PATH.sub("", _repr(annotation))


def _repr(value: object) -> str:
    return _ADDRESS.sub("", repr(value))


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
