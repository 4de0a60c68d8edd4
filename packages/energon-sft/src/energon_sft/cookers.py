"""Cookers: crude Energon samples (tar members or JSONL rows) -> `ChatSample`.

Energon asserts that every cooker is `@stateless` (the shuffle buffer is checkpointed as
restore keys and re-cooked on resume). `functools.partial` drops that mark, so options are
bound with `make_stateless_cooker`, which returns a real function carrying the mark, and
`check_cookers` rejects unmarked callables up front instead of failing on every sample.

Row formats:

- canonical (`cook_chat`, the default): `{"id"?, "messages": [...], "media"?: [...], "tools"?}`.
  A media entry is a tar member name (`"m0.png"`), `{"member": "m0.png"}`, or, for JSONL
  datasets that have no members, `{"b64": "<base64>", "name": "..."}`.
- ShareGPT (`cook_sharegpt`, subflavor `sft_format: sharegpt`): `{"conversations": [{"from",
  "value"}], "images"?: [...]}` with `<image>` placeholders in the text.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

from megatron.energon import Cooker, basic_sample_keys, stateless
from megatron.energon.task_encoder.base import get_stateless

from energon_sft.errors import BadSampleError
from energon_sft.schema import ChatSample, MediaItem, validate_conversation

__all__ = [
    "SubflavorCooker",
    "check_cookers",
    "cook_chat",
    "cook_sharegpt",
    "default_cookers",
    "make_stateless_cooker",
]


def _row(crude: dict[str, Any]) -> dict[str, Any]:
    raw = crude.get("json")
    if raw is None:
        raise BadSampleError("missing_field", "the sample has no .json member / JSONL row")
    # JSONL datasets hand over a dict already; tar members arrive as bytes (decoder=None).
    if isinstance(raw, bytes | bytearray):
        try:
            raw = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadSampleError("bad_json", f"the .json member is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise BadSampleError("bad_json", f"the row is a {type(raw).__name__}, expected an object")
    return raw


def _media(crude: dict[str, Any], entries: Any) -> list[MediaItem]:
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise BadSampleError("missing_field", "'media' must be a list")
    items = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            entry = {"member": entry}
        if not isinstance(entry, dict):
            raise BadSampleError("missing_field", f"media[{i}] is neither a name nor an object")
        kind = str(entry.get("type", "image"))
        if "member" in entry:
            name = str(entry["member"])
            # Exact member name only: suffix or extension fallbacks silently pick the wrong
            # file when two members share a suffix.
            data = crude.get(name)
            if not isinstance(data, bytes | bytearray):
                members = sorted(k for k in crude if not k.startswith("__") and k != "json")
                raise BadSampleError(
                    "missing_media",
                    f"media[{i}] names member {name!r}, which the sample lacks "
                    f"(members: {members})",
                )
        elif "b64" in entry:
            name = str(entry.get("name", f"media[{i}]"))
            try:
                data = base64.b64decode(entry["b64"], validate=True)
            except (binascii.Error, TypeError) as exc:
                raise BadSampleError("bad_media", f"media[{i}] has invalid base64: {exc}") from exc
        else:
            raise BadSampleError("missing_field", f"media[{i}] needs 'member' or 'b64'")
        items.append(MediaItem(name=name, data=bytes(data), kind=kind))
    return items


def _finish(crude: dict[str, Any], row: dict[str, Any], messages: Any, media: Any) -> ChatSample:
    items = _media(crude, media)
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadSampleError("missing_field", "'tools' must be a list of tool schemas")
    return ChatSample(
        **basic_sample_keys(crude),
        messages=validate_conversation(messages, len(items)),
        media=items,
        tools=tools,
        source_id=str(row.get("id", crude["__key__"])),
    )


@stateless
def cook_chat(crude: dict[str, Any], **aux: Any) -> ChatSample:
    """Cook a canonical row (see the module docstring) into a `ChatSample`."""
    row = _row(crude)
    if "messages" not in row:
        raise BadSampleError("missing_field", "the row has no 'messages'")
    return _finish(crude, row, row["messages"], row.get("media"))


_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant"}
_SHAREGPT_ROLES |= {"assistant": "assistant", "tool": "tool", "function_call": "assistant"}


@stateless
def cook_sharegpt(crude: dict[str, Any], **aux: Any) -> ChatSample:
    """Cook a ShareGPT row (`conversations` of `{from, value}`, `<image>` placeholders)."""
    row = _row(crude)
    turns = row.get("conversations")
    if not isinstance(turns, list):
        raise BadSampleError("missing_field", "the ShareGPT row has no 'conversations' list")
    messages: list[dict[str, Any]] = []
    next_image = 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise BadSampleError("missing_field", f"conversations[{i}] needs 'from' and 'value'")
        role = _SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise BadSampleError(
                "unknown_role",
                f"conversations[{i}] has from={turn['from']!r}; "
                f"expected one of {sorted(_SHAREGPT_ROLES)}",
            )
        pieces = str(turn["value"]).split("<image>")
        if len(pieces) == 1:
            messages.append({"role": role, "content": pieces[0]})
            continue
        parts: list[dict[str, Any]] = []
        for j, text in enumerate(pieces):
            if j > 0:
                parts.append({"type": "image", "media_index": next_image})
                next_image += 1
            if text:
                parts.append({"type": "text", "text": text})
        messages.append({"role": role, "content": parts})
    return _finish(crude, row, messages, row.get("images"))


def make_stateless_cooker(fn: Callable[..., ChatSample], /, **options: Any) -> Callable[..., Any]:
    """Bind `options` to a cooker function and keep Energon's `@stateless` mark.

    `functools.partial(fn, **options)` would lose the mark (Energon then fails every sample);
    this returns a plain function that carries it.
    """
    if not get_stateless(fn):
        raise ValueError(
            f"cooker {fn!r} is not marked @stateless; decorate it with "
            "megatron.energon.stateless (it must not keep state between samples)"
        )

    @functools.wraps(fn)
    def bound(crude: dict[str, Any], **aux: Any) -> ChatSample:
        return fn(crude, **options, **aux)

    return stateless(bound)


def check_cookers(cookers: Sequence[Cooker[Any]]) -> None:
    """Reject cooker lists Energon would only fail on later, sample by sample.

    Every `cook` must be `@stateless`; at most one cooker may lack a subflavor filter and it
    must be last (Energon takes the first match, so anything after it is dead).
    """
    if not cookers:
        raise ValueError("no cookers given; pass energon_sft.default_cookers() or your own")
    for i, cooker in enumerate(cookers):
        if not get_stateless(cooker.cook):
            hint = (
                " (functools.partial drops the mark; use make_stateless_cooker)"
                if isinstance(cooker.cook, functools.partial)
                else ""
            )
            raise ValueError(f"cooker {i} ({cooker.cook!r}) is not @stateless{hint}")
        if cooker.has_subflavors is None and i != len(cookers) - 1:
            raise ValueError(
                f"cooker {i} has no subflavor filter but is not last; it would shadow "
                f"cookers {list(range(i + 1, len(cookers)))}. Move it to the end."
            )


class SubflavorCooker(Cooker[Any]):
    """A `Cooker` whose subflavor filter also works on datasets without subflavors.

    Energon's `Cooker.is_match` fails with a TypeError when a dataset has no subflavors at
    all (JSONL datasets pass None); here None counts as "no subflavors", so the filter simply
    does not match.
    """

    def is_match(self, subflavors: dict[str, Any] | None) -> bool:
        """Energon's match, with None read as no subflavors."""
        return super().is_match(subflavors or {})


def default_cookers() -> list[Cooker[Any]]:
    """ShareGPT rows for subflavor `sft_format: sharegpt`, canonical rows for everything else."""
    return [
        SubflavorCooker(cook_sharegpt, has_subflavors={"sft_format": "sharegpt"}),
        SubflavorCooker(cook_chat),
    ]
