"""The embedded demo: a learnable chat task with exact answers and a local character tokenizer.

The task is deterministic from a seed, so the train and held-out splits are reproducible and
disjoint (a question never appears in both).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PreTrainedTokenizerFast

    from train_recipes.config.sft import SFTConfig
    from train_recipes.data.energon_api import ChatRow

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
PAD, UNK, SYSTEM, USER, ASSISTANT, END = SPECIAL_TOKENS
# Qwen2.5-VL's image block markers (the VLM demo); placed after the characters in the vocabulary.
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
# A chat template in the usual Jinja form: every message is `<|role|>content<|end|>`; an image
# part renders as one `<|vision_start|><|image_pad|><|vision_end|>` block (energon-sft expands the
# pad to the image's token count). The generation prompt is the assistant header, so greedy
# decoding starts right at the answer.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(kw_only=True, slots=True, frozen=True)
class DemoSplit:
    """Paths of a demo dataset written by :func:`write_demo_dataset`.

    Attributes:
        train_jsonl: training chats (JSONL, one ``{"messages": [...]}`` per line).
        eval_jsonl: held-out chats; the last message is the reference answer.
        energon_dir: the prepared Energon dataset of ``train_jsonl``.
    """

    train_jsonl: Path
    eval_jsonl: Path
    energon_dir: Path


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer with the demo chat template, built locally.

    Every printable ASCII character is one token; the role markers are special tokens.

    Returns:
        A ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + chars + list(VISION_TOKENS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # characters join back without spaces
    core.add_special_tokens(list(SPECIAL_TOKENS) + list(VISION_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=END,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, *VISION_TOKENS],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    return tokenizer


def _question(task: str, rng: random.Random) -> tuple[str, str]:
    if task == "addition":
        a, b = rng.randrange(100), rng.randrange(100)
        return f"{a}+{b}=", str(a + b)
    if task == "reverse":
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
        return f"reverse {word}", word[::-1]
    raise ValueError(f"unknown demo task {task!r}; expected 'addition' or 'reverse'")


def demo_chats(
    task: str, *, train_size: int, eval_size: int, seed: int
) -> tuple[list[ChatRow], list[ChatRow]]:
    """Generate train and held-out chats; no held-out question occurs in the train split.

    Returns:
        (train, held_out), each a list of ``{"messages": [user, assistant]}`` rows.
    """
    rng = random.Random(seed)
    held: dict[str, str] = {}
    while len(held) < eval_size:
        q, a = _question(task, rng)
        held[q] = a
    train: list[ChatRow] = []
    while len(train) < train_size:
        q, a = _question(task, rng)
        if q not in held:
            train.append(_chat(q, a))
    return train, [_chat(q, a) for q, a in held.items()]


COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 200, 20),
}
SHAPES = ("circle", "square", "triangle")
IMAGE_SIZE = 56  # 2x2 merged 14-pixel patches per side: 4 image tokens per picture


def draw_shape(shape: str, colour: str, rng: random.Random) -> Image.Image:
    """A white IMAGE_SIZE^2 RGB picture with one filled shape at a random place and size."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    size = rng.randint(18, 34)
    x, y = rng.randint(2, IMAGE_SIZE - size - 2), rng.randint(2, IMAGE_SIZE - size - 2)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse((x, y, x + size, y + size), fill=fill)
    elif shape == "square":
        draw.rectangle((x, y, x + size, y + size), fill=fill)
    else:
        draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return img


def shape_chats(
    out_dir: Path, *, train_size: int, eval_size: int, seed: int
) -> tuple[list[ChatRow], list[ChatRow]]:
    """CLEVR-like picture questions (colour or shape of the one object), images as PNG files.

    Returns:
        (train, held_out) rows; ``media`` lists PNG paths relative to ``out_dir``.
    """
    rng = random.Random(seed)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rows: list[ChatRow] = []
    for i in range(train_size + eval_size):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        name = f"images/{i:06d}.png"
        draw_shape(shape, colour, rng).save(out_dir / name)
        if rng.random() < 0.5:
            question, answer = "colour?", colour
        else:
            question, answer = "shape?", shape
        rows.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "media_index": 0},
                            {"type": "text", "text": question},
                        ],
                    },
                    {"role": "assistant", "content": answer},
                ],
                "media": [name],
            }
        )
    return rows[eval_size:], rows[:eval_size]


def _chat(question: str, answer: str) -> ChatRow:
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    }


def _write_jsonl(path: Path, rows: list[ChatRow]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def read_jsonl(path: str | Path) -> Iterator[ChatRow]:
    """Rows of a JSONL file."""
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def write_demo_dataset(
    out_dir: str | Path,
    *,
    task: str = "addition",
    train_size: int = 20000,
    eval_size: int = 200,
    seed: int = 0,
) -> DemoSplit:
    """Write the demo chats as JSONL and convert the train split to an Energon dataset.

    Idempotent: an existing complete dataset with the same settings is reused.

    Args:
        out_dir: the folder to write (``train.jsonl``, ``eval.jsonl``, ``energon/``).
        task: "addition" (two-digit sums), "reverse" (reverse a 3-6 letter word) or "shapes"
            (a picture with one coloured shape; asks its colour or its shape).
        train_size: training chats.
        eval_size: held-out chats.
        seed: generation seed.

    Returns:
        The written paths.
    """
    from train_recipes.data.energon_api import convert_chat_jsonl

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    split = DemoSplit(
        train_jsonl=out / "train.jsonl", eval_jsonl=out / "eval.jsonl", energon_dir=out / "energon"
    )
    stamp = out / "settings.json"
    settings = {"task": task, "train_size": train_size, "eval_size": eval_size, "seed": seed}
    if (
        stamp.is_file()
        and json.loads(stamp.read_text()) == settings
        and (split.energon_dir / ".nv-meta").is_dir()
    ):
        logger.info("reusing the demo dataset in %s", out)
        return split
    if task == "shapes":
        train, held = shape_chats(out, train_size=train_size, eval_size=eval_size, seed=seed)
    else:
        train, held = demo_chats(task, train_size=train_size, eval_size=eval_size, seed=seed)
    _write_jsonl(split.train_jsonl, train)
    _write_jsonl(split.eval_jsonl, held)
    convert_chat_jsonl(split.train_jsonl, split.energon_dir)
    stamp.write_text(json.dumps(settings))
    return split


def sft_data_paths(config: SFTConfig, out_dir: Path, *, is_main: bool) -> tuple[Path, Path | None]:
    """The Energon dataset path and the held-out JSONL of an SFT run.

    ``data.path`` and ``data.eval_path``, or the demo's, which the main rank writes under
    ``out_dir/data`` (the others wait).
    """
    if config.data.path is not None:
        eval_path = Path(config.data.eval_path) if config.data.eval_path else None
        return Path(config.data.path), eval_path
    import torch.distributed as dist

    data_dir = out_dir / "data"
    if is_main:
        write_demo_dataset(
            data_dir,
            task=config.data.demo,
            train_size=config.data.demo_train_size,
            eval_size=config.data.demo_eval_size,
            seed=config.train.seed,
        )
    dist.barrier()
    return data_dir / "energon", data_dir / "eval.jsonl"
