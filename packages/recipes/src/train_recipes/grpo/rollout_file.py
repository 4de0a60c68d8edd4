"""The rollout-file source: rollouts an external generator (vLLM, SGLang) wrote as JSONL.

One line per sample; the samples of one prompt (a group) are on consecutive lines::

    {"group": "q17",                       # any JSON value; equal on a group's lines
     "prompt_ids": [3, 23, 24, 17, 5],     # or "messages": [{"role": "user", ...}], rendered
                                           #   with the tokenizer's chat template + generation
                                           #   prompt
     "completion_ids": [30, 31, 5],        # the sampled tokens (end-of-turn token included)
     "reward": 1.0,                        # the group's advantages are normalised from these
     "advantages": [0.7, 0.7, 0.7],        # optional, one per completion token (replaces the
                                           #   group-normalised reward)
     "old_log_probs": [-0.1, -0.3, -0.02]} # optional, one per completion token: the sampling
                                           #   log-probs (else computed before the first update)

MoE routes (``"routes"``) are refused: router replay of a rollout's routes is not implemented.
The whole file is checked before launch (:func:`read_rollout_file`): the first bad line is
named in one line. Batches take ``rollout.groups_per_batch`` consecutive groups, from the
start again after the last.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, cast

from torch import nn

from train_recipes.config.grpo import RolloutConfig
from train_recipes.grpo.rollouts import Rollout, rank_group_indices

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from train_recipes.run.process_group import RankContext

__all__ = ["FileRollouts", "RolloutFileError", "read_rollout_file"]

_KEYS = {"group", "prompt_ids", "messages", "completion_ids", "reward", "advantages"}
_KEYS |= {"old_log_probs", "routes"}


class RolloutFileError(ValueError):
    """A rollout file's line the recipe cannot train on (the message names it)."""


def _ints(value: object, what: str, vocab: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a non-empty list of token ids")
    for tok in value:
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ValueError(f"{what} holds {tok!r}, not a token id")
        if not 0 <= tok < vocab:
            raise ValueError(
                f"{what} holds token {tok}, outside the tokenizer's vocabulary [0, {vocab}); "
                "were the rollouts generated with another tokenizer?"
            )
    return tuple(value)


def _floats(value: object, what: str, length: int) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) != length:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{what} has {got} entries, the completion {length} tokens")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in value):
        raise ValueError(f"{what} must hold finite numbers")
    return tuple(float(v) for v in value)


def _parse(row: object, tokenizer: PreTrainedTokenizerBase, max_length: int) -> tuple[str, Rollout]:
    if not isinstance(row, dict):
        raise ValueError("a line must hold a JSON object")
    unknown = sorted(set(row) - _KEYS)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; a row has {sorted(_KEYS)}")
    if "routes" in row:
        raise ValueError(
            "carries MoE routes: router replay of rollout routes is not supported yet; drop "
            "the routes (the update then routes afresh)"
        )
    if "group" not in row:
        raise ValueError("has no 'group' (the prompt its samples share)")
    vocab = len(tokenizer)
    if ("prompt_ids" in row) == ("messages" in row):
        raise ValueError("needs exactly one of 'prompt_ids' and 'messages'")
    if "messages" in row:
        rendered = tokenizer.apply_chat_template(
            row["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt = tuple(cast("list[int]", rendered))
    else:
        prompt = _ints(row["prompt_ids"], "prompt_ids", vocab)
    completion = _ints(row.get("completion_ids"), "completion_ids", vocab)
    if len(prompt) + len(completion) > max_length:
        raise ValueError(
            f"prompt and completion hold {len(prompt) + len(completion)} tokens, more than "
            f"data.max_length={max_length}; raise it"
        )
    advantages = None
    if "advantages" in row:
        advantages = _floats(row["advantages"], "advantages", len(completion))
    reward = row.get("reward")
    if reward is None and advantages is None:
        raise ValueError("needs a 'reward' (or per-token 'advantages')")
    if reward is not None and (
        isinstance(reward, bool)
        or not isinstance(reward, (int, float))
        or not math.isfinite(reward)
    ):
        raise ValueError(f"reward {reward!r} is not a finite number")
    old = None
    if "old_log_probs" in row:
        old = _floats(row["old_log_probs"], "old_log_probs", len(completion))
        if any(v > 0 for v in old):
            raise ValueError("old_log_probs holds a positive value; log-probs are <= 0")
    rollout = Rollout(
        group=0,
        prompt_ids=prompt,
        completion_ids=completion,
        reward=float(reward or 0.0),
        advantages=advantages,
        old_log_probs=old,
    )
    return json.dumps(row["group"]), rollout


def read_rollout_file(
    path: str | Path, tokenizer: PreTrainedTokenizerBase, *, max_length: int
) -> list[list[Rollout]]:
    """The file's groups of rollouts, every line checked.

    Raises:
        RolloutFileError: naming the file, the line and what is wrong with it.
    """
    groups: list[list[Rollout]] = []
    seen: set[str] = set()
    last: str | None = None
    with Path(path).open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                key, rollout = _parse(json.loads(line), tokenizer, max_length)
            except (ValueError, TypeError) as err:
                reason = "is not JSON" if isinstance(err, json.JSONDecodeError) else str(err)
                raise RolloutFileError(f"{path} line {number}: {reason}") from None
            if key != last:
                if key in seen:
                    raise RolloutFileError(
                        f"{path} line {number}: group {key} appeared before, apart from these "
                        "lines; write a group's samples on consecutive lines"
                    )
                seen.add(key)
                groups.append([])
                last = key
            groups[-1].append(rollout)
    if not groups:
        raise RolloutFileError(f"{path} holds no rollouts")
    return groups


class FileRollouts:
    """The rollout file as a :class:`~train_recipes.grpo.rollouts.RolloutSource`.

    Args:
        groups: :func:`read_rollout_file`'s result.
        rollout: ``groups_per_batch`` and ``minibatches``.
        ctx: this rank's place in the mesh.
    """

    def __init__(
        self, groups: list[list[Rollout]], *, rollout: RolloutConfig, ctx: RankContext
    ) -> None:
        self._groups, self._rollout, self._ctx = groups, rollout, ctx
        self._cursor = 0  # groups drawn so far

    def state_dict(self) -> dict[str, object]:
        """The file position."""
        return {"cursor": self._cursor}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Continue from :meth:`state_dict`'s result."""
        self._cursor = cast(int, state["cursor"])

    def next_batch(self, model: nn.Module) -> list[Rollout]:
        """This rank's groups of the next ``groups_per_batch`` groups of the file."""
        rollout, ctx = self._rollout, self._ctx
        indices = rank_group_indices(
            rollout.groups_per_batch,
            minibatches=rollout.minibatches,
            dp_rank=ctx.dp_rank,
            dp_size=ctx.dp_size,
        )
        n = len(self._groups)
        out = []
        for local, g in enumerate(indices):
            for r in self._groups[(self._cursor + g) % n]:
                out.append(
                    Rollout(
                        group=local,
                        prompt_ids=r.prompt_ids,
                        completion_ids=r.completion_ids,
                        reward=r.reward,
                        advantages=r.advantages,
                        old_log_probs=r.old_log_probs,
                    )
                )
        self._cursor += rollout.groups_per_batch
        return out
