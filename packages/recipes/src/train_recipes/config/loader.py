"""Typed YAML loading for keyword-only dataclass configs: strict conversion, dotted overrides.

Pure Python with no torch import, so a config is read and rejected (naming the offending key)
before any process group starts or any process is launched. The recipe schemas are in
:mod:`train_recipes.config.sft` and :mod:`train_recipes.config.retrieval`; :mod:`train_recipes.config`
re-exports this module's names with them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeAlias, TypeGuard, TypeVar, cast

import yaml

__all__ = [
    "ConfigError",
    "JSONValue",
    "config_from_dict",
    "field_types",
    "leaf_keys",
    "load_config",
    "parse_override",
    "read_tree",
    "to_dict",
]

T = TypeVar("T")

#: Plain data as YAML and JSON hold it: a config tree, an override's value, a saved record.
JSONValue: TypeAlias = "str | int | float | bool | list[JSONValue] | dict[str, JSONValue] | None"


class ConfigError(ValueError):
    """A config value is unknown, has the wrong type or contradicts another one.

    Attributes:
        key: the dotted key at fault, e.g. ``"parallel.ddp.static_graph"``, or the command-line
            option at fault (``"--config"``, ``"--set"``), which the message calls an option.
    """

    def __init__(self, key: str, message: str) -> None:
        what = "option" if key.startswith("--") else "config key"
        super().__init__(f"{what} '{key}': {message}")
        self.key = key


class _TorchDtype:
    """Stands for ``torch.dtype`` in annotations resolved before torch is imported.

    A YAML value is never a torch.dtype, so the loader rejects this alternative as it would
    the real one, and ``--help`` leaves it out as a Python-only type.
    """


# What ``torch`` names in the annotations of train-engine's FSDP2Config (``torch.dtype``).
_TORCH_ANNOTATIONS = types.SimpleNamespace(dtype=_TorchDtype)


def field_types(cls: type) -> dict[str, object]:
    """``typing.get_type_hints(cls)`` without importing torch.

    train-engine's FSDP2Config annotates ``torch.dtype`` without importing torch; the name
    resolves to torch itself once it is imported, else to a stand-in.
    """
    return typing.get_type_hints(
        cls, localns={"torch": sys.modules.get("torch", _TORCH_ANNOTATIONS)}
    )


def _is_config(tp: object) -> TypeGuard[type]:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _convert(value: object, tp: object, key: str) -> object:
    """Check and convert one YAML value to the annotated type (strict: no silent casts)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(key, f"{value!r} matches none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"{value!r} is not one of {list(args)}")
        return value
    if _is_config(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(key, f"expected {len(args)} values, got {len(value)}")
        return tuple(
            _convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=False))
        )
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads `2e-5` (no dot) as a string; accept any float literal.
            try:
                return float(value)
            except ValueError:
                raise ConfigError(key, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise ConfigError(key, f"unsupported config type {tp}")  # pragma: no cover - schema bug


def _build(cls: type[T], data: Mapping[str, object], prefix: str = "") -> T:
    hints = field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    for key in data:
        if key not in names:
            full = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(full, f"unknown key; {cls.__name__} accepts {names}")
    kwargs = {}
    for name in names:
        if name in data:
            full = f"{prefix}.{name}" if prefix else name
            kwargs[name] = _convert(data[name], hints[name], full)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, JSONValue], key: str, value: JSONValue) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), f"is a value, cannot set '{key}' under it")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, JSONValue]:
    """Split ``a.b=value``; the value is read as YAML (``2e-5``, ``true``, ``[1, 2]``, ``null``)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(text, "an override must look like key.sub=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(
            key, f"the value {raw!r} is not valid YAML ({_first_line(err)}); quote it or fix it"
        ) from None
    return key, value


def _first_line(err: Exception) -> str:
    return " ".join(str(err).split())


def load_config(
    cls: type[T],
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Read a YAML config (or start from the defaults) and apply dotted overrides.

    Args:
        cls: :class:`SFTConfig` or :class:`RetrievalConfig`.
        path: a YAML file; None starts from the class defaults.
        overrides: ``key.sub=value`` strings applied after the file.

    Returns:
        The frozen config.

    Raises:
        ConfigError: an unknown key or a value of the wrong type, naming the key; a missing or
            unreadable YAML file (key ``"--config"``).
    """
    return _build(cls, read_tree(path, overrides))


def read_tree(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> dict[str, JSONValue]:
    """The plain data a config is built from: the YAML file, then the dotted overrides.

    Raises:
        ConfigError: a missing or unreadable YAML file (key ``"--config"``), a bad override.
    """
    tree: dict[str, JSONValue] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(
                "--config",
                f"{path} does not exist; list the shipped configs with `train-recipes config ls`",
            )
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as err:
            raise ConfigError("--config", f"{path} is not valid YAML: {_first_line(err)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError("<root>", f"{path} must hold a mapping, got {type(loaded).__name__}")
        tree = loaded
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    return tree


def leaf_keys(tree: object, prefix: str = "") -> set[str]:
    """The dotted keys of a config tree's values (``{"data": {"path": x}}`` -> ``data.path``)."""
    if not isinstance(tree, dict):
        return {prefix.rstrip(".")} if prefix else set()
    out: set[str] = set()
    for key, value in tree.items():
        out |= leaf_keys(value, f"{prefix}{key}.")
    return out


def config_from_dict(cls: type[T], tree: Mapping[str, object]) -> T:
    """Build a config from nested plain data (e.g. a saved ``config.yaml``), strictly.

    Raises:
        ConfigError: an unknown key or a value of the wrong type, naming the key.
    """
    return _build(cls, tree)


def to_dict(config: object) -> dict[str, JSONValue]:
    """The config as plain YAML-serialisable data (tuples become lists)."""

    def plain(value: object) -> JSONValue:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        return cast(JSONValue, value)  # a leaf field: str, int, float, bool or None

    result = plain(config)
    assert isinstance(result, dict)
    return result
