"""Test fixtures for energon-sft built locally: tokenizer, chat template, processor, datasets.

Imported by the tests and by the subprocess scripts of the kill-and-resume test, so it keeps
imports light and builds everything from explicit parameters (no downloads).
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from energon_sft.schema import ChatSample

# build_sft_loader's options for a single-process test that reads the dataset in its order: one
# data-parallel rank, no worker processes, no shuffling.
ONE_RANK_IN_ORDER: Mapping[str, Any] = MappingProxyType(
    {"dp_rank": 0, "dp_world_size": 1, "num_workers": 0, "seed": 0, "shuffle": False}
)


# ChatML-like; image parts render as one placeholder block, tool calls as JSON.
CHAT_TEMPLATE = (
    "{%- if tools -%}{{ '<|im_start|>tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- elif m['content'] -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- else -%}{{ p['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if m['tool_calls'] -%}{%- for c in m['tool_calls'] -%}"
    "{{ '<tool_call>' + (c['function'] | tojson) + '</tool_call>' }}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

CORPUS = [
    "You are a helpful assistant. Answer briefly.",
    "What is in the picture? A red square and a blue circle.",
    "The weather in Paris is sunny today, twenty degrees.",
    "Call the tool get_weather with the city name.",
    "user assistant system tool tools tool_call name arguments city",
    "Hello! How are you? I am fine, thank you. Tell me a joke.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
] * 4


def build_tokenizer() -> Any:
    """A byte-level BPE trained on a tiny corpus, wrapped as a fast tokenizer with a template."""
    from train_testing.tiny_hf import tiny_tokenizer

    return tiny_tokenizer(CORPUS, vocab_size=400, chat_template=CHAT_TEMPLATE)


class LocalProcessor:
    """The two parts a Qwen2.5-VL processor carries, built from explicit parameters."""

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor


MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64


def build_image_processor() -> Any:
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )


def build_processor(tokenizer: Any | None = None) -> LocalProcessor:
    return LocalProcessor(tokenizer or build_tokenizer(), build_image_processor())


def png_bytes(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(4):
        x, y = rng.randrange(width), rng.randrange(height)
        img.putpixel((x, y), tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image_question(text: str) -> list[dict[str, Any]]:
    """A user message's content: image 0, then `text`."""
    return [{"type": "image", "media_index": 0}, {"type": "text", "text": text}]


def chat_rows(n: int, *, seed: int = 0, image_every: int = 2) -> list[dict[str, Any]]:
    """Canonical rows; every `image_every`-th row has an image (media given as file names)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = " ".join(rng.choice(CORPUS).split()[: rng.randint(2, 6)])
        user: Any = f"Question {i}: {words}?"
        media = []
        if image_every and i % image_every == 0:
            user = image_question(user)
            media = [f"img{i}.png"]
        rows.append(
            {
                "id": f"row-{i}",
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": f"Answer {i}: {words}."},
                ],
                "media": media,
            }
        )
    return rows


def image_chat_row(row_id: str, question: str, answer: str, image: Any) -> dict[str, Any]:
    """A canonical row: `question` about one image (a file name or an inline media dict)."""
    user = {"role": "user", "content": image_question(question)}
    return {
        "id": row_id,
        "messages": [user, {"role": "assistant", "content": answer}],
        "media": [image],
    }


def chat_sample(
    messages: list[dict[str, Any]],
    media: Sequence[bytes] = (),
    *,
    tools: list[dict[str, Any]] | None = None,
    key: str = "k0",
    source_id: str = "src-0",
) -> ChatSample:
    """A cooked sample of `messages`, as a cooker gives it; `media[i]` is named `m{i}.png`."""
    from energon_sft.schema import ChatSample, MediaItem

    return ChatSample(
        __key__=key,
        __restore_key__=(),
        messages=messages,
        media=[MediaItem(name=f"m{i}.png", data=d) for i, d in enumerate(media)],
        tools=tools,
        source_id=source_id,
    )


def write_images(root: Path, rows: list[dict[str, Any]], *, seed: int = 0) -> None:
    rng = random.Random(seed)
    for row in rows:
        for name in row.get("media", []):
            w, h = rng.choice([(56, 56), (84, 56), (40, 70)])
            (root / name).write_bytes(png_bytes(w, h, rng.randrange(1 << 30)))


def build_dataset(
    root: Path, rows: list[dict[str, Any]], *, samples_per_shard: int = 8, seed: int = 0
) -> Path:
    """Write media files + shards for `rows` and run real `energon prepare`."""
    from energon_sft import write_chat_shards
    from energon_sft.dataset import prepare_dataset

    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    write_images(media, rows, seed=seed)
    ds = root / "ds"
    write_chat_shards(rows, ds, media_root=media, samples_per_shard=samples_per_shard)
    return prepare_dataset(ds)


def batch_digest(batch: Any) -> str:
    """sha256 over the content of a batch: ids, labels, pixels, grids, keys."""
    import hashlib

    h = hashlib.sha256()
    for t in (batch.input_ids, batch.labels, batch.image_grid_thw, batch.cu_seqlens):
        h.update(t.contiguous().numpy().tobytes())
    if batch.pixel_values is not None:
        h.update(batch.pixel_values.contiguous().numpy().tobytes())
    h.update(",".join(batch.source_ids).encode())
    return h.hexdigest()
