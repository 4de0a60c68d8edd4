"""A package's public surface, read by importing it: the part of an API record that `inspect` gives.

`train_testing.api_surface` compares these surfaces with the records of released versions and
decides the bump; this module only says what the surface is.

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
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import cast

from train_testing.workspace import RECIPES_DIST

__all__ = ["Entry", "Surface", "package_surface", "public_modules"]

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
