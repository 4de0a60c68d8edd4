"""Held-out exact match: greedy decoding of chat answers, split over all ranks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from train_recipes.data.energon_api import ChatMessage, ChatRow
from train_recipes.data.processors import tokenizer_of

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PreTrainedTokenizerBase

    from train_recipes.data.processors import Processor

__all__ = ["exact_match_accuracy", "greedy_answers"]


class ImageProcessor(Protocol):
    """A Qwen2-VL image processor: images -> ``pixel_values`` and ``image_grid_thw``."""

    merge_size: int  # patches merged per side into one image token

    def __call__(
        self, *, images: list[Image.Image], return_tensors: str
    ) -> Mapping[str, torch.Tensor]:
        """``pixel_values`` [P, D] and ``image_grid_thw`` [N, 3] of ``images``."""
        ...


def _full(logits: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return logits.full_tensor() if isinstance(logits, DTensor) else logits


@torch.no_grad()
def greedy_answers(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[list[ChatMessage]],
    *,
    max_new_tokens: int,
    device: torch.device,
    batch_size: int = 64,
    num_batches: int | None = None,
    images: Sequence[list[Image.Image]] | None = None,
    image_processor: ImageProcessor | None = None,
    length_multiple: int = 1,
) -> list[str]:
    """Greedy-decode an answer for each chat prompt (messages without the final answer).

    Decoding recomputes the whole right-padded sequence at every step: no attention mask and
    no KV cache are needed (causal attention never sees the padding to the right), which keeps
    it exact for any batch composition. Every rank runs exactly ``num_batches`` batches of
    ``max_new_tokens`` forwards (padding the list with copies), so sharded models (FSDP2), whose
    forward is collective, stay in lock-step.

    With ``images`` (one list of PIL images per prompt) and a Qwen2-VL ``image_processor``, each
    ``<|image_pad|>`` placeholder is expanded to its image's token count and the pixels are
    passed with every forward, with the same [4, B, S] M-RoPE position ids as in training.

    ``length_multiple``: every forward's sequence length is rounded up to a multiple of it
    (more right padding, which causal attention never reads); tensor parallelism with
    sequence-parallel norms needs a multiple of tp.

    Returns:
        The decoded answer text of each prompt (up to the end-of-turn token).
    """
    was_training = model.training
    model.eval()
    end_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id
    encoded = [
        list(
            cast(
                "list[int]",  # tokenize=True, return_dict=False: the token ids
                tokenizer.apply_chat_template(
                    # transformers annotates text contents only; a list of parts renders too
                    cast("list[dict[str, str]]", p),
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                ),
            )
        )
        for p in prompts
    ]
    pixels: list[dict[str, torch.Tensor] | None] = [None] * len(encoded)
    if images is not None:
        assert image_processor is not None  # images come with their processor
        image_pad = cast(int, tokenizer.convert_tokens_to_ids("<|image_pad|>"))  # one token
        merge = int(image_processor.merge_size) ** 2
        for i, imgs in enumerate(images):
            if not imgs:
                continue
            feats = image_processor(images=list(imgs), return_tensors="pt")
            counts = iter([int(g.prod()) // merge for g in feats["image_grid_thw"]])
            expanded: list[int] = []
            for tok in encoded[i]:
                expanded.extend([image_pad] * next(counts) if tok == image_pad else [tok])
            encoded[i] = expanded
            pixels[i] = {
                "pixel_values": torch.as_tensor(feats["pixel_values"]),
                "image_grid_thw": torch.as_tensor(feats["image_grid_thw"]),
            }
    needed = (len(encoded) + batch_size - 1) // batch_size
    total_batches = needed if num_batches is None else num_batches
    answers: list[str] = []
    for b in range(total_batches):
        real = b * batch_size < len(encoded)
        lo = b * batch_size if real else 0
        chunk = encoded[lo : lo + batch_size] or [[pad_id]]
        parts = [p for p in pixels[lo : lo + batch_size] if p is not None]
        extra = {k: torch.cat([p[k] for p in parts]).to(device) for k in parts[0]} if parts else {}
        lengths = torch.tensor([len(x) for x in chunk])
        width = -(-(int(lengths.max()) + max_new_tokens) // length_multiple) * length_multiple
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for i, x in enumerate(chunk):
            ids[i, : len(x)] = torch.tensor(x)
        positions = None
        if images is not None:
            from train_recipes.data import energon_api as data_api

            assert image_processor is not None
            positions = data_api.mrope_positions_for_prompts(
                ids,
                ids == image_pad,
                extra["image_grid_thw"] if extra else torch.zeros((0, 3), dtype=torch.long),
                spatial_merge_size=int(image_processor.merge_size),
            ).to(device)
        ids = ids.to(device)
        cur = lengths.clone().to(device)
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        rows = torch.arange(len(chunk), device=device)
        for _ in range(max_new_tokens):
            width_now = -(-int(cur.max()) // length_multiple) * length_multiple
            if positions is not None:
                extra["position_ids"] = positions[..., :width_now]
            logits = _full(model(input_ids=ids[:, :width_now], use_cache=False, **extra).logits)
            nxt = logits[rows, cur - 1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            ids[rows, cur] = nxt
            done |= nxt == end_id
            cur = cur + 1
        if real:
            for i in range(len(chunk)):
                gen = ids[i, int(lengths[i]) :].tolist()
                if end_id in gen:
                    gen = gen[: gen.index(end_id)]
                answers.append(cast(str, tokenizer.decode(gen, skip_special_tokens=True)))
    model.train(was_training)
    return answers


def exact_match_accuracy(
    model: nn.Module,
    processor: Processor,
    rows: Sequence[ChatRow],
    *,
    max_new_tokens: int,
    device: torch.device,
    batch_size: int = 64,
    media_root: str | Path | None = None,
    tp: int = 1,
) -> float:
    """Held-out exact-match accuracy by greedy decoding, split over all ranks (collective).

    Args:
        model: the (unwrapped) model; FSDP2 models stay sharded (every rank decodes).
        processor: the tokenizer, or a processor with ``.tokenizer`` and ``.image_processor``.
        rows: chats whose last message is the reference assistant answer; ``media`` paths are
            relative to ``media_root``.
        max_new_tokens: the greedy decoding budget per answer.
        device: this rank's device.
        batch_size: prompts decoded together.
        media_root: the folder ``media`` paths are relative to (None: the working directory).
        tp: tensor-parallel degree; each tp group decodes the same rows together.

    Returns:
        The fraction of rows whose decoded answer equals the reference (stripped), same on
        every rank.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    # Ranks of one tensor-parallel group (tp innermost in the mesh) decode the same rows.
    replica, replicas = rank // tp, world // tp
    mine = list(rows)[replica::replicas]
    per_rank = (len(rows) + replicas - 1) // replicas
    num_batches = max(1, (per_rank + batch_size - 1) // batch_size)
    images = None
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is not None:
        from PIL import Image

        root = Path(media_root) if media_root is not None else Path(".")
        images = [
            [Image.open(root / m).convert("RGB") for m in cast("list[str]", r.get("media", []))]
            for r in mine
        ]
    answers = greedy_answers(
        model,
        tokenizer_of(processor),
        [cast("list[ChatMessage]", r["messages"])[:-1] for r in mine],
        max_new_tokens=max_new_tokens,
        device=device,
        batch_size=batch_size,
        num_batches=num_batches,
        images=images,
        image_processor=image_processor,
        length_multiple=tp,  # sequence-parallel norms split each forward's rows into tp parts
    )
    correct = sum(
        a.strip() == cast(str, cast("list[ChatMessage]", r["messages"])[-1]["content"]).strip()
        for a, r in zip(answers, mine, strict=False)
    )
    counts = torch.tensor([correct, len(mine)], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(counts)
    return float(counts[0] / counts[1].clamp(min=1))
