"""Row formats users arrive with, and their mapping to the canonical `messages` row.

- `messages` (canonical): `{"id"?, "messages": [...], "media"?: [...], "tools"?: [...]}`.
- `sharegpt`: `{"id"?, "conversations": [{"from": "human"|"gpt"|"system", "value"}],
  "images"?: [...]}` with `<image>` placeholders in the text. The mapping is the loader's own
  ShareGPT cooker (`energon_sft.cookers.cook_sharegpt`), so there is one ShareGPT reading.
- `alpaca`: `{"id"?, "instruction", "input"?, "output", "system"?}` -> an optional system turn,
  one user turn (instruction, then input after a blank line when non-empty) and one assistant
  turn. Alpaca rows carry no media.

Rows of another format than the one asked for are rejected with reason `wrong_format` and a
message that names the `--format` that fits (`format_hint`).
"""

from __future__ import annotations

from typing import Any, Literal

from energon_sft.errors import BadSampleError

__all__ = ["FORMATS", "RowFormat", "alpaca_messages", "check_format", "guess_format", "media_key"]

RowFormat = Literal["messages", "sharegpt", "alpaca"]

#: The formats `energon-sft convert --format` accepts.
FORMATS: tuple[RowFormat, ...] = ("messages", "sharegpt", "alpaca")

# The field that marks a row as one format (checked in this order).
_MARKERS: tuple[tuple[RowFormat, str], ...] = (
    ("messages", "messages"),
    ("sharegpt", "conversations"),
    ("alpaca", "instruction"),
)


def guess_format(row: dict[str, Any]) -> RowFormat | None:
    """The format whose marker field (`messages`, `conversations`, `instruction`) the row has."""
    for fmt, field in _MARKERS:
        if field in row:
            return fmt
    return None


def media_key(fmt: RowFormat) -> str | None:
    """The row field that lists media files in `fmt` (None: the format has no media)."""
    return {"messages": "media", "sharegpt": "images", "alpaca": None}[fmt]


def check_format(row: dict[str, Any], fmt: RowFormat) -> None:
    """Reject a row that lacks the marker field of `fmt`, naming the format it looks like.

    Raises:
        BadSampleError: reason `wrong_format` when another format's marker is present,
            `missing_field` when none is.
    """
    marker = dict(_MARKERS)[fmt]
    if marker in row:
        return
    guessed = guess_format(row)
    if guessed is not None:
        raise BadSampleError(
            "wrong_format",
            f"the row has {dict(_MARKERS)[guessed]!r} but no {marker!r}: it looks like "
            f"{guessed} rows; pass --format {guessed}",
        )
    fields = sorted(row)[:8]
    raise BadSampleError(
        "missing_field",
        f"the row has no {marker!r} (fields: {fields}); expected {fmt} rows "
        f"(--format {'|'.join(FORMATS)})",
    )


def alpaca_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Map an Alpaca row to OpenAI-style messages (validated later like any other row).

    Raises:
        BadSampleError: reason `missing_field` when `instruction` or `output` is not a string
            or `input` / `system` is neither absent nor a string.
    """
    for field in ("instruction", "output"):
        if not isinstance(row.get(field), str):
            raise BadSampleError(
                "missing_field", f"the Alpaca row needs a string {field!r} (got {row.get(field)!r})"
            )
    for field in ("input", "system"):
        if row.get(field) is not None and not isinstance(row[field], str):
            raise BadSampleError(
                "missing_field", f"the Alpaca row's {field!r} must be a string when given"
            )
    user = row["instruction"]
    if row.get("input"):
        user = f"{user}\n\n{row['input']}"
    messages: list[dict[str, Any]] = []
    if row.get("system"):
        messages.append({"role": "system", "content": row["system"]})
    messages.append({"role": "user", "content": user})
    messages.append({"role": "assistant", "content": row["output"]})
    return messages
