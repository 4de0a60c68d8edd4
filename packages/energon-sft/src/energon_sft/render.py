r"""Render a conversation with the tokenizer's own chat template and mark the trained tokens.

Approach (chosen over `{% generation %}` markers, which few templates carry): render the whole
conversation once and tokenize it once with character offsets, so the token ids are exactly
those of the full render (tokenizing per-message deltas can merge differently at the seams).
The character span of assistant turn i is found by rendering prefixes:

- it starts where `render(messages[:i], add_generation_prompt=True)` ends, so the
  generation header (`<|im_start|>assistant\n`) is prompt, not target;
- it ends where `render(messages[:i + 1])` ends, so the content, any tool calls, and the
  template's end-of-turn tokens (`<|im_end|>\n`) are trained: the model must learn to stop.

A token is trained when its first character falls inside a trained span. Templates that do not
render prefixes consistently (the prefix of the conversation is not a prefix of the text) are
rejected for that sample with reason `template_not_prefix_stable`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from energon_sft.errors import BadSampleError

__all__ = ["RenderedConversation", "TrainOn", "render_conversation"]

#: Which assistant turns are trained: every one, or only the last.
TrainOn = Literal["all_assistant", "final_assistant"]


@dataclass(kw_only=True, slots=True)
class RenderedConversation:
    """Tokens of one rendered conversation before image expansion.

    Attributes:
        text: the rendered string.
        input_ids: token ids of `text`.
        trained: per token, True when the token is an assistant target (unshifted).
        spans: [start, end) character spans of the trained assistant turns.
    """

    text: str
    input_ids: list[int]
    trained: list[bool]
    spans: list[tuple[int, int]]


def _template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    # Image parts keep `media_index` (templates ignore unknown keys) and gain the HF-style
    # `image` marker some templates test for.
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            parts = [dict(p, image=True) if p.get("type") == "image" else p for p in content]
            msg = dict(msg, content=parts)
        out.append(msg)
    return out


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    generation_prompt: bool,
) -> str:
    if not messages:
        # HF refuses to render an empty conversation; nothing precedes the first turn.
        return ""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )
    if not isinstance(text, str):
        raise TypeError(
            f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str"
        )
    return text


def render_conversation(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    train_on: TrainOn = "all_assistant",
) -> RenderedConversation:
    """Render `messages` with `tokenizer`'s chat template; mark assistant tokens as trained.

    Args:
        tokenizer: a fast tokenizer with a chat template (offsets are needed).
        messages: validated canonical messages.
        tools: tool schemas passed to the template.
        train_on: "all_assistant" or "final_assistant" (only the last assistant turn).

    Returns:
        The rendered text, its token ids and per-token trained flags.
    """
    if train_on not in ("all_assistant", "final_assistant"):
        raise ValueError(f"train_on={train_on!r}; expected 'all_assistant' or 'final_assistant'")
    msgs = _template_messages(messages)
    full = _render(tokenizer, msgs, tools, generation_prompt=False)
    assistant_turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if train_on == "final_assistant":
        assistant_turns = assistant_turns[-1:]
    spans: list[tuple[int, int]] = []
    for i in assistant_turns:
        # The last turn's prefix is the whole conversation: its render is `full` (the usual
        # single-answer chat then renders twice, not three times).
        last = i == len(msgs) - 1
        upto = full if last else _render(tokenizer, msgs[: i + 1], tools, generation_prompt=False)
        if not full.startswith(upto):
            raise BadSampleError(
                "template_not_prefix_stable",
                f"rendering messages[:{i + 1}] is not a prefix of the full render; this chat "
                "template rewrites earlier turns and cannot be masked by prefix rendering",
            )
        header = _render(tokenizer, msgs[:i], tools, generation_prompt=True)
        if upto.startswith(header):
            start = len(header)
        else:
            # Templates without a distinct generation prompt: train the whole turn.
            start = len(_render(tokenizer, msgs[:i], tools, generation_prompt=False))
        spans.append((start, len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    trained = [any(s <= off[0] < e for s, e in spans) for off in offsets]
    return RenderedConversation(text=full, input_ids=ids, trained=trained, spans=spans)
