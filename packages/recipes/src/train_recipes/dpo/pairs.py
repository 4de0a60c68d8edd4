"""Preference pairs: the JSONL row format, its checks, encoding with the chat template, batches.

A row (one JSON object per line)::

    {"prompt": [{"role": "user", "content": "37+45="}],
     "chosen": "82", "rejected": "81",
     "ref_chosen_logp": -1.2, "ref_rejected_logp": -3.4}   # optional, both or neither

``prompt`` is a list of chat messages (``role``, ``content``) ending with a user turn;
``chosen`` and ``rejected`` are the assistant answers' text. Each answer is rendered as the
chat ``prompt + [{"role": "assistant", "content": answer}]`` with the tokenizer's chat template
(the one the SFT recipe trains with; ``data.chat_template`` replaces it), and only the
answer's tokens (those after the rendered generation prompt, the end-of-turn token included)
are scored. A micro-batch of P pairs is 2P rows, the chosen answers first: both answers of a
pair are always in the same micro-batch.

# P pairs, S sequence
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "EncodedPair",
    "PairError",
    "PairRow",
    "PairSampler",
    "check_pair_row",
    "collate_pairs",
    "encode_pair",
    "read_pair_rows",
]

IGNORE_INDEX = -100
REFERENCE_COLUMNS = ("ref_chosen_logp", "ref_rejected_logp")

#: A checked row: ``prompt`` (messages), ``chosen``, ``rejected`` and the optional columns.
PairRow = Mapping[str, object]


class PairError(ValueError):
    """A pair row the recipe cannot train on; the message names the file and line."""


def check_pair_row(row: object, where: str) -> PairRow:
    """Check one row's fields.

    Raises:
        PairError: a missing or empty prompt, a prompt not ending with a user turn, an empty
            chosen or rejected answer, one reference column without the other, or a
            non-number reference log-prob.
    """
    if not isinstance(row, Mapping):
        raise PairError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise PairError(
            f"{where}: 'prompt' is missing or empty; give a list of chat messages "
            '(e.g. [{"role": "user", "content": "..."}])'
        )
    for message in prompt:
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise PairError(f"{where}: every prompt message needs a 'role' and a text 'content'")
    if prompt[-1]["role"] != "user":
        raise PairError(
            f"{where}: the prompt ends with a {prompt[-1]['role']!r} turn; it must end with "
            "the user turn the answers reply to"
        )
    for side in ("chosen", "rejected"):
        answer = row.get(side)
        if not isinstance(answer, str) or not answer.strip():
            raise PairError(f"{where}: '{side}' is missing or empty; give the answer's text")
    present = [key in row for key in REFERENCE_COLUMNS]
    if any(present) and not all(present):
        raise PairError(f"{where}: give both {' and '.join(REFERENCE_COLUMNS)} or neither")
    for key in REFERENCE_COLUMNS:
        if key in row and not isinstance(row[key], (int, float)):
            raise PairError(f"{where}: '{key}' must be a number, got {row[key]!r}")
    return row


def read_pair_rows(path: str | Path) -> list[PairRow]:
    """Every row of a pairs JSONL file, checked (:func:`check_pair_row`).

    Raises:
        PairError: the first bad row (or no row at all, or mixed rows with and without the
            reference columns), naming the file and line.
    """
    rows: list[PairRow] = []
    with Path(path).open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                parsed = json.loads(line)
            except json.JSONDecodeError as err:
                raise PairError(f"{where}: not JSON ({err.msg})") from None
            row = check_pair_row(parsed, where)
            if rows and (REFERENCE_COLUMNS[0] in row) != (REFERENCE_COLUMNS[0] in rows[0]):
                raise PairError(
                    f"{where}: some rows have the reference columns and some do not; give "
                    "them on every row or on none"
                )
            rows.append(row)
    if not rows:
        raise PairError(f"{path}: holds no pair")
    return rows


@dataclass(kw_only=True, slots=True, frozen=True)
class EncodedPair:
    """One pair's token ids.

    Attributes:
        chosen: prompt + chosen answer token ids.
        chosen_start: index of the chosen answer's first token.
        rejected: prompt + rejected answer token ids.
        rejected_start: index of the rejected answer's first token.
        reference: (chosen, rejected) reference log-probs from the row's columns, or None.
    """

    chosen: tuple[int, ...]
    chosen_start: int
    rejected: tuple[int, ...]
    rejected_start: int
    reference: tuple[float, float] | None = None


def _render_ids(tokenizer: PreTrainedTokenizerBase, messages: list[object], gen: bool) -> list[int]:
    chat = cast("list[dict[str, str]]", messages)  # checked by check_pair_row
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def encode_pair(
    tokenizer: PreTrainedTokenizerBase, row: PairRow, *, max_length: int, where: str
) -> EncodedPair:
    """Render and tokenize both answers of ``row``.

    Raises:
        PairError: an answer that does not fit ``max_length`` tokens, or a chat template whose
            full chat does not start with its rendered generation prompt.
    """
    prompt = list(row["prompt"])  # type: ignore[call-overload]
    prompt_ids = _render_ids(tokenizer, prompt, True)
    encoded: list[tuple[tuple[int, ...], int]] = []
    for side in ("chosen", "rejected"):
        full = _render_ids(tokenizer, [*prompt, {"role": "assistant", "content": row[side]}], False)
        if full[: len(prompt_ids)] != prompt_ids or len(full) == len(prompt_ids):
            raise PairError(
                f"{where}: the chat template's rendering of the {side} answer does not extend "
                "its generation prompt; set data.chat_template to a template that does"
            )
        if len(full) > max_length:
            raise PairError(
                f"{where}: the {side} answer's chat is {len(full)} tokens, more than "
                f"data.max_length={max_length}; raise data.max_length or shorten the row"
            )
        encoded.append((tuple(full), len(prompt_ids)))
    reference = None
    if REFERENCE_COLUMNS[0] in row:
        reference = (float(row[REFERENCE_COLUMNS[0]]), float(row[REFERENCE_COLUMNS[1]]))  # type: ignore[arg-type]
    (chosen, chosen_start), (rejected, rejected_start) = encoded
    return EncodedPair(
        chosen=chosen,
        chosen_start=chosen_start,
        rejected=rejected,
        rejected_start=rejected_start,
        reference=reference,
    )


def collate_pairs(
    pairs: Sequence[EncodedPair], *, pad_token_id: int, pad_to_multiple_of: int = 1
) -> dict[str, Tensor]:
    """The 2P rows of a micro-batch: the chosen answers, then the rejected ones.

    Returns:
        ``input_ids`` [2P, S], ``position_ids`` [2P, S] (padding continues the row),
        ``labels`` [2P, S] (shifted: position t scores token t+1; -100 off the answer) and,
        when every pair has them, ``reference`` [2P] float32 log-probs from the columns.
    """
    rows = [(p.chosen, p.chosen_start) for p in pairs] + [
        (p.rejected, p.rejected_start) for p in pairs
    ]
    length = max(len(ids) for ids, _ in rows)
    length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, start) in enumerate(rows):
        row = torch.tensor(ids, dtype=torch.long)
        input_ids[i, : len(ids)] = row
        # Position t predicts token t+1: the answer's tokens are predicted from start-1 on.
        labels[i, start - 1 : len(ids) - 1] = row[start:]
    batch = {
        "input_ids": input_ids,
        "position_ids": torch.arange(length).expand(len(rows), length).contiguous(),
        "labels": labels,
    }
    if all(p.reference is not None for p in pairs):
        refs = [p.reference for p in pairs if p.reference is not None]
        batch["reference"] = torch.tensor(
            [c for c, _ in refs] + [r for _, r in refs], dtype=torch.float32
        )
    return batch


class PairSampler:
    """Which pairs each rank's micro-batches take at each step, a function of the step alone.

    The pairs form an endless stream (a seeded permutation per epoch when shuffled); step s
    takes its next ``dp * accumulation * P`` pairs, and rank r's micro-batch m is chunk
    ``r * accumulation + m`` of them. The global batch of a step is therefore the same for
    any split over ranks and accumulation, and a resume needs no loader state (the step
    says where the stream is).

    Args:
        num_pairs: pairs in the dataset.
        micro_batch_size: P.
        seed: the shuffle's seed.
        shuffle: permute each epoch (False: file order).
    """

    def __init__(self, num_pairs: int, *, micro_batch_size: int, seed: int, shuffle: bool) -> None:
        self.num_pairs, self.micro_batch_size = num_pairs, micro_batch_size
        self.seed, self.shuffle = seed, shuffle
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.num_pairs))
            if self.shuffle:
                random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch kept: a step spans at most a few
        return self._orders[epoch]

    def _at(self, position: int) -> int:
        return self._order(position // self.num_pairs)[position % self.num_pairs]

    def micro_batch(self, step: int, *, rank: int, dp: int, accumulation: int, m: int) -> list[int]:
        """Pair indices of rank ``rank``'s micro-batch ``m`` of step ``step`` (from 1)."""
        p = self.micro_batch_size
        start = (step - 1) * dp * accumulation * p + (rank * accumulation + m) * p
        return [self._at(position) for position in range(start, start + p)]

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint records (the position is the step's)."""
        return {"num_pairs": self.num_pairs, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, object] | Iterable[Mapping[str, object]]) -> None:
        """Check a saved state (one rank's, or every old rank's) against these pairs.

        Raises:
            ValueError: the checkpoint was trained on another number of pairs or order.
        """
        states = [state] if isinstance(state, Mapping) else list(state)
        for saved in states:
            if dict(saved) != self.state_dict():
                raise ValueError(
                    f"the checkpoint's pairs {dict(saved)} differ from this run's "
                    f"{self.state_dict()}; resume with the same data and train.seed"
                )
