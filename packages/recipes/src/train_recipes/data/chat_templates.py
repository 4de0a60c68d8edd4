"""Chat templates for tokenizers that have none: ``data.chat_template``, by name or Jinja file.

A named template is one of :data:`TEMPLATES`; anything else is read as the path of a Jinja file.
Each named template renders a conversation prefix as a prefix of the whole (energon-sft masks
the assistant turns by rendering prefixes) and has a generation prompt, the assistant header,
so the header is prompt and the turn's end marker is trained: the model learns to stop.

Which one fits a tokenizer: ``chatml`` and ``llama3`` spell their turn markers as special
tokens (``<|im_end|>``, ``<|eot_id|>``) that Qwen and Llama 3 tokenizers have; for another
tokenizer they are plain text and generation does not stop at them (the data report warns).
``zephyr`` ends each turn with the tokenizer's own ``eos_token`` and fits any tokenizer.

Pure Python, no torch import: the launching process reads it before any rank starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TEMPLATES",
    "NamedTemplate",
    "check_chat_template",
    "read_chat_template",
    "resolve_chat_template",
]

# A message's content is a string, or a list of parts whose text parts are rendered in order;
# an image part becomes Qwen2-VL's vision block (energon-sft expands its pad token).
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)


@dataclass(kw_only=True, slots=True, frozen=True)
class NamedTemplate:
    """A chat template shipped with the recipes.

    Attributes:
        source: the Jinja source.
        end_of_turn: the token that ends a turn (what generation stops at); None when it is
            the tokenizer's ``eos_token``.
        fits: the tokenizers it is written for.
    """

    source: str
    end_of_turn: str | None
    fits: str


TEMPLATES: dict[str, NamedTemplate] = {
    "chatml": NamedTemplate(
        source=(
            "{% for message in messages %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' }}" + _CONTENT + "{{ '<|im_end|>\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
        ),
        end_of_turn="<|im_end|>",
        fits="Qwen and other tokenizers with <|im_start|>/<|im_end|> tokens",
    ),
    "llama3": NamedTemplate(
        source=(
            "{{ bos_token }}{% for message in messages %}"
            "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
            + _CONTENT
            + "{{ '<|eot_id|>' }}{% endfor %}"
            "{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
        ),
        end_of_turn="<|eot_id|>",
        fits="Llama 3 tokenizers",
    ),
    "zephyr": NamedTemplate(
        source=(
            "{% for message in messages %}"
            "{{ '<|' + message['role'] + '|>\\n' }}" + _CONTENT + "{{ eos_token + '\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
        ),
        end_of_turn=None,
        fits="any tokenizer (turns end with its eos_token)",
    ),
}


def resolve_chat_template(value: str) -> str:
    """The Jinja source ``data.chat_template`` names: a shipped template or a file's text.

    Raises:
        ValueError: neither a known name nor a readable file (the message lists the names).
    """
    named = TEMPLATES.get(value)
    if named is not None:
        return named.source
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(
            f"{value!r} is neither a named template ({', '.join(TEMPLATES)}) nor a Jinja file"
        )
    return path.read_text(encoding="utf-8")


def read_chat_template(model_dir: str | Path) -> str | None:
    """The chat template a model folder's tokenizer files carry, without loading them.

    transformers reads it from ``chat_template.jinja`` (newer saves), ``tokenizer_config.json``
    (``chat_template``, a string or a list of named templates) or, for processors,
    ``chat_template.json``.
    """
    folder = Path(model_dir)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8") or None
    for name in ("tokenizer_config.json", "chat_template.json", "processor_config.json"):
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        template = data.get("chat_template") if isinstance(data, dict) else None
        if template:
            return json.dumps(template) if not isinstance(template, str) else template
    return None


def check_chat_template(model_path: str | None, chat_template: str | None) -> None:
    """``data.chat_template`` names a template, or the model's tokenizer has its own.

    Raises:
        ConfigError: an unknown name or missing file, or a model whose tokenizer has no chat
            template while the key is unset (one line naming ``data.chat_template``).
    """
    from train_recipes.config.loader import ConfigError

    if chat_template is not None:
        try:
            resolve_chat_template(chat_template)
        except (ValueError, OSError) as err:
            raise ConfigError("data.chat_template", str(err)) from None
        return
    if model_path is not None and read_chat_template(model_path) is None:
        raise ConfigError(
            "data.chat_template",
            f"the tokenizer of {model_path} has no chat template, so chats cannot be rendered; "
            f"set data.chat_template to {' / '.join(TEMPLATES)} (see train_recipes."
            "chat_templates) or to a Jinja file",
        )
