"""The canonical chat sample every cooker produces and every encoder consumes.

A conversation is OpenAI-style: `messages` is a list of `{"role", "content", ...}` where
`content` is a string or a list of parts. A text part is `{"type": "text", "text": str}`; an
image part is `{"type": "image", "media_index": i}` and points at `media[i]`. Media items stay
undecoded bytes until the encoder runs, so the shuffle buffer holds small samples and a corrupt
image is caught (and counted) where it is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron.energon import Sample
from megatron.energon.edataclass import edataclass

from energon_sft.errors import BadSampleError

__all__ = ["ROLES", "ChatSample", "MediaItem", "image_order", "validate_conversation"]

#: Roles a conversation may use; anything else is a bad sample (`unknown_role`).
ROLES = ("system", "user", "assistant", "tool")


@dataclass(kw_only=True, slots=True, frozen=True)
class MediaItem:
    """One undecoded media item of a sample.

    Attributes:
        name: where it came from (tar member, file name); shown in error messages.
        data: the encoded bytes (PNG, JPEG, ...).
        kind: "image" (the only kind the built-in adapters decode).
    """

    name: str
    data: bytes
    kind: str = "image"


@edataclass
class ChatSample(Sample):
    """A cooked chat sample (Energon `Sample`, so it keeps its key and restore key).

    Attributes:
        messages: validated OpenAI-style messages; image parts carry `media_index`.
        media: the sample's media items, addressed by index from the messages.
        tools: optional tool schemas handed to the chat template.
        source_id: a stable id of the row in its source (the row's `id`, else the Energon key).
    """

    messages: list[dict[str, Any]]
    media: list[MediaItem]
    tools: list[dict[str, Any]] | None
    source_id: str


def _check_part(part: Any, msg_i: int, n_media: int) -> None:
    if not isinstance(part, dict) or "type" not in part:
        raise BadSampleError(
            "bad_content", f"message {msg_i}: content part {part!r} is not a dict with a 'type'"
        )
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise BadSampleError("missing_field", f"message {msg_i}: text part lacks 'text'")
    elif kind == "image":
        idx = part.get("media_index")
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise BadSampleError(
                "missing_field", f"message {msg_i}: image part needs an int 'media_index'"
            )
        if not 0 <= idx < n_media:
            raise BadSampleError(
                "media_index_out_of_range",
                f"message {msg_i}: media_index {idx} outside [0, {n_media}) "
                f"(the sample has {n_media} media items)",
            )
    else:
        raise BadSampleError(
            "bad_content", f"message {msg_i}: content part type {kind!r} is not 'text' or 'image'"
        )


def validate_conversation(messages: Any, n_media: int) -> list[dict[str, Any]]:
    """Check the structure of `messages` and return it as a list of dicts.

    Raises:
        BadSampleError: with reason `missing_field`, `unknown_role`, `bad_content`,
            `media_index_out_of_range` or `no_assistant`.
    """
    if not isinstance(messages, list) or not messages:
        raise BadSampleError("missing_field", "'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise BadSampleError("missing_field", f"message {i} has no 'role'")
        role = msg["role"]
        if role not in ROLES:
            raise BadSampleError(
                "unknown_role", f"message {i} has role {role!r}; expected one of {list(ROLES)}"
            )
        content = msg.get("content")
        if content is None:
            if role == "assistant" and msg.get("tool_calls"):
                continue
            raise BadSampleError("missing_field", f"message {i} ({role}) has no 'content'")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise BadSampleError(
                "bad_content", f"message {i}: content must be a string or a list of parts"
            )
        for part in content:
            _check_part(part, i, n_media)
    if not any(m["role"] == "assistant" for m in messages):
        raise BadSampleError("no_assistant", "the conversation has no assistant message")
    return messages


def image_order(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Media indices of the image parts in the order the template renders them."""
    order: list[int] = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            order.extend(p["media_index"] for p in content if p.get("type") == "image")
    return order
