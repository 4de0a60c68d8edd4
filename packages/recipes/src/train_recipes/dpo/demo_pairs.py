"""The DPO demo's pairs: the addition task's right answer against a wrong one.

The questions are the SFT demo's (same seed: the held-out split is the one the SFT demo
measures and never trains on). The rejected answer is the policy's own greedy answer where
that is wrong (the mistakes DPO should move probability away from), else a near miss of the
right sum (off by 1, 2 or 10).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from train_recipes.data.demo import demo_chats
from train_recipes.evaluation.exact_match import greedy_answers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from train_recipes.data.energon_api import ChatMessage, ChatRow
    from train_recipes.dpo.pairs import PairRow

__all__ = ["demo_heldout_rows", "demo_pair_rows", "near_miss"]


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong sum close to ``answer`` (a non-negative integer as text)."""
    value = int(answer)
    options = [value + d for d in (-10, -2, -1, 1, 2, 10) if value + d >= 0]
    return str(rng.choice(options))


def demo_heldout_rows(*, eval_size: int, seed: int) -> list[ChatRow]:
    """The demo's held-out chats (the SFT demo's split for the same seed and size)."""
    return demo_chats("addition", train_size=0, eval_size=eval_size, seed=seed)[1]


def demo_pair_rows(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    *,
    num_pairs: int,
    eval_size: int,
    seed: int,
    device: torch.device,
    max_new_tokens: int,
) -> list[PairRow]:
    """``num_pairs`` pairs from the demo's training questions (collective: every rank decodes).

    Args:
        model: the unwrapped policy (FSDP2 stays sharded: every rank decodes in lock-step).
        tokenizer: the run's tokenizer.
        num_pairs: pairs to build.
        eval_size: the held-out split's size (its questions are never used).
        seed: the demo's seed (``train.seed``).
        device: this rank's device.
        max_new_tokens: greedy decoding budget.

    Returns:
        The same rows on every rank.
    """
    train, _ = demo_chats("addition", train_size=num_pairs, eval_size=eval_size, seed=seed)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    prompts = [cast("list[ChatMessage]", row["messages"])[:-1] for row in train]
    mine = prompts[rank::world]
    batch_size = 64
    per_rank = -(-len(prompts) // world)
    answers = greedy_answers(
        model,
        tokenizer,
        mine,
        max_new_tokens=max_new_tokens,
        device=device,
        batch_size=batch_size,
        num_batches=max(1, -(-per_rank // batch_size)),
    )
    gathered: list[list[str]] = [answers]
    if world > 1:
        gathered = [[] for _ in range(world)]
        dist.all_gather_object(gathered, answers)
    greedy = [""] * len(prompts)
    for r, part in enumerate(gathered):
        for i, text in enumerate(part[: len(prompts[r::world])]):
            greedy[r + i * world] = text
    rng = random.Random(seed)
    rows: list[PairRow] = []
    for prompt, row, guess in zip(prompts, train, greedy, strict=True):
        right = str(cast("list[ChatMessage]", row["messages"])[-1]["content"])
        wrong = guess.strip()
        if not wrong or wrong == right or len(wrong) > len(right) + 2:  # fits max_length
            wrong = near_miss(right, rng)
        rows.append({"prompt": prompt, "chosen": right, "rejected": wrong})
    return rows
