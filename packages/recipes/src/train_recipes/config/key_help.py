"""The config keys as ``sft --help`` lists them: dotted name, YAML type, default, description.

Generated from the dataclasses (types from their annotations, descriptions from their
``Attributes:`` docstring sections), so the help cannot drift from the schema.
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Literal

import yaml

from train_recipes.config.loader import field_types
from train_recipes.config.retrieval import RetrievalTrainConfig
from train_recipes.config.sft import TrainConfig


def _is_yaml_type(tp: object) -> bool:
    return typing.get_origin(tp) in (Literal, tuple) or dataclasses.is_dataclass(tp)


def _type_name(tp: object) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        # Python-only alternatives (a torch.dtype besides its name) cannot be written in YAML.
        shown = [a for a in args if a.__module__ in ("builtins", "typing") or _is_yaml_type(a)]
        return " | ".join("null" if a is type(None) else _type_name(a) for a in shown)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list[{_type_name(args[0])}]"
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    return getattr(tp, "__name__", str(tp))


def _yaml_value(value: object, limit: int = 48) -> str:
    text = yaml.safe_dump(to_dict_value(value), default_flow_style=True, width=10_000).strip()
    text = text.removesuffix("\n...").strip()  # a scalar document ends with "..."
    if len(text) > limit:
        count = len(value) if isinstance(value, tuple) else None
        text = text[: limit - 5].rstrip(", ") + ", ...]" + (f" ({count} items)" if count else "")
    return text


def to_dict_value(value: object) -> object:
    """A field value as plain YAML data (tuples become lists)."""
    return [to_dict_value(v) for v in value] if isinstance(value, tuple) else value


def _attribute_docs(cls: type) -> dict[str, str]:
    """``name -> description`` from a Google-style ``Attributes:`` docstring section."""
    docs: dict[str, str] = {}
    lines = (cls.__doc__ or "").splitlines()
    inside, current, indent = False, None, 0
    for line in lines:
        stripped = line.strip()
        if stripped == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if not stripped:
            current = None
            continue
        lead = len(line) - len(line.lstrip())
        name, sep, rest = stripped.partition(":")
        if sep and name.isidentifier() and (current is None or lead <= indent):
            current, indent = name, lead
            docs[name] = rest.strip()
        elif current is not None:
            docs[current] += " " + stripped
    return docs


# A section documented by another one's docstring (same field names, same meaning).
_DOCS_FROM: dict[type, type] = {RetrievalTrainConfig: TrainConfig}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class KeyDoc:
    """One config key for ``--help``: dotted name, YAML type, default, description."""

    key: str
    type: str
    default: str
    description: str


def config_keys(cls: type, prefix: str = "", defaults: object = None) -> Iterator[KeyDoc]:
    """Every leaf key of a config class, depth first, in field order.

    Args:
        cls: a config dataclass.
        prefix: the dotted path of ``cls`` in the root config.
        defaults: the instance whose values are the defaults (a parent's default differs
            from the section's own, e.g. RetrievalConfig's optim); None builds ``cls()``.
    """
    hints = field_types(cls)
    docs = _attribute_docs(_DOCS_FROM.get(cls, cls)) | _attribute_docs(cls)
    default_obj = cls() if defaults is None else defaults
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from config_keys(tp, f"{key}.", getattr(default_obj, f.name))
            continue
        yield KeyDoc(
            key=key,
            type=_type_name(tp),
            default=_yaml_value(getattr(default_obj, f.name)),
            description=docs.get(f.name, ""),
        )


def keys_help(cls: type) -> str:
    """The text ``sft --help`` / ``retrieval --help`` ends with: every key, type and default."""
    out = [
        f"config keys ({cls.__name__}; set them in the YAML file or with --set KEY=VALUE; "
        "`train-recipes config show` prints a resolved config):"
    ]
    for doc in config_keys(cls):
        out.append(f"  {doc.key}  ({doc.type}, default {doc.default})")
        if doc.description:
            out.extend(
                textwrap.wrap(
                    doc.description, 96, initial_indent="      ", subsequent_indent="      "
                )
            )
    return "\n".join(out)
