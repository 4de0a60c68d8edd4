"""The loader-vs-step benchmark's dataset: photo-like pictures, short chats, a local processor.

``write_dataset`` writes chat JSONL + image files and converts them the way the VLM demo does
(``convert_chat_jsonl``); ``build_processor`` is the recipes' character tokenizer with a
PIL-backend Qwen2-VL image processor. Used by ``loader_vs_step.py`` (next to this file).
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("loader_vs_step")

# Qwen2-VL's spatial merge: one image placeholder token per 2 x 2 patches.
MERGE_SIZE = 2

_WORD_TEXT = (
    "the a an of in on at to with and or is are was there this that what which where how many "
    "color colour red green blue yellow white black small large left right top bottom middle "
    "picture image photo shows contains object objects shape circle square triangle line text "
    "person people car tree house sky water road sign table chair window door light dark near "
    "far behind front next between both first second describe explain compare count read"
)
WORDS = _WORD_TEXT.split()


def make_image(rng: Any, size: int) -> Any:
    """A photo-like RGB picture: a smooth colour field, a few shapes, sensor-like noise.

    The noise keeps JPEG/PNG files at realistic sizes (flat drawings compress to almost
    nothing and decode unrealistically fast).
    """
    import numpy as np
    from PIL import Image, ImageDraw

    coarse = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(coarse).resize((size, size), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 6))):
        x0, y0 = (int(v) for v in rng.integers(0, size * 3 // 4, size=2))
        w, h = (int(v) for v in rng.integers(size // 10, size // 3, size=2))
        fill = tuple(int(v) for v in rng.integers(0, 256, size=3))
        box = (x0, y0, x0 + w, y0 + h)
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    arr = np.asarray(img, dtype=np.int16) + rng.normal(0, 10, size=(size, size, 3)).astype(np.int16)
    return Image.fromarray(arr.clip(0, 255).astype(np.uint8))


def _words(rng: random.Random, lo: int, hi: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
    return text[0].upper() + text[1:]


def make_chat(rng: random.Random, n_images: int) -> list[dict[str, Any]]:
    """1-3 turns; the images open the first user message. About 100-450 characters of text."""
    messages: list[dict[str, Any]] = []
    for turn in range(rng.randint(1, 3)):
        question = _words(rng, 4, 12) + "?"
        if turn == 0:
            parts: list[dict[str, Any]] = [
                {"type": "image", "media_index": j} for j in range(n_images)
            ]
            parts.append({"type": "text", "text": question})
            messages.append({"role": "user", "content": parts})
        else:
            messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": _words(rng, 6, 24) + "."})
    return messages


def write_dataset(
    out_dir: Path,
    *,
    num_samples: int,
    image_size: int,
    image_format: str,
    two_image_fraction: float,
    seed: int,
) -> tuple[Path, dict[str, Any]]:
    """Chat JSONL + image files -> a prepared Energon dataset (the VLM demo's path).

    Reused when ``out_dir`` already holds one written with the same settings.

    Returns:
        (the Energon dataset folder, dataset statistics).
    """
    import numpy as np

    from train_recipes.data.energon_api import convert_chat_jsonl

    settings = {
        "num_samples": num_samples,
        "image_size": image_size,
        "image_format": image_format,
        "two_image_fraction": two_image_fraction,
        "seed": seed,
    }
    energon_dir = out_dir / "energon"
    stamp = out_dir / "settings.json"
    if stamp.is_file() and (energon_dir / ".nv-meta").is_dir():
        saved = json.loads(stamp.read_text())
        if saved.get("settings") == settings:
            logger.info("reusing the dataset in %s", out_dir)
            return energon_dir, saved["stats"]
    t0 = time.perf_counter()
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    suffix = {"jpeg": ".jpg", "png": ".png"}[image_format]
    n_images = 0
    image_bytes = 0
    text_chars = 0
    jsonl = out_dir / "train.jsonl"
    with jsonl.open("w") as f:
        for i in range(num_samples):
            k = 2 if rng.random() < two_image_fraction else 1
            media = []
            for j in range(k):
                name = f"images/{i:07d}_{j}{suffix}"
                img = make_image(np_rng, image_size)
                if image_format == "jpeg":
                    img.save(out_dir / name, quality=90)
                else:
                    img.save(out_dir / name)
                image_bytes += (out_dir / name).stat().st_size
                media.append(name)
            messages = make_chat(rng, k)
            text_chars += sum(
                len(m["content"])
                if isinstance(m["content"], str)
                else sum(len(p.get("text", "")) for p in m["content"])
                for m in messages
            )
            n_images += k
            f.write(json.dumps({"messages": messages, "media": media}) + "\n")
    convert_chat_jsonl(jsonl, energon_dir)
    stats = {
        "samples": num_samples,
        "images": n_images,
        "images_per_sample": n_images / num_samples,
        "mean_image_kib": image_bytes / max(n_images, 1) / 1024,
        "mean_text_chars_per_sample": text_chars / num_samples,
        "write_s": time.perf_counter() - t0,
    }
    stamp.write_text(json.dumps({"settings": settings, "stats": stats}))
    logger.info("wrote %d samples (%d images) in %.1f s", num_samples, n_images, stats["write_s"])
    return energon_dir, stats


def build_processor(image_size: int) -> Any:
    """The recipes' local processor: character tokenizer + PIL Qwen2-VL image processor.

    Pixel bounds are Qwen2.5-VL's usual ones (56^2 .. 1280 * 28^2), so an image keeps its size
    (a multiple of 28) and gives (side / 28)^2 tokens.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from train_recipes.data.demo import build_char_tokenizer
    from train_recipes.data.processors import LocalProcessor

    if image_size % 28:
        raise SystemExit(f"--image-size {image_size} must be a multiple of 28 (patch 14 x merge 2)")
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56,
        max_pixels=1280 * 28 * 28,
        patch_size=14,
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
    )
    return LocalProcessor(build_char_tokenizer(), image_processor)
