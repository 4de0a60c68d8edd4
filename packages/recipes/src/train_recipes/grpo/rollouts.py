"""Rollouts: what a source hands the policy update, and which of a batch's groups a rank trains.

A rollout batch is ``rollout.groups_per_batch`` prompt groups (G samples of one prompt each).
It is split into ``rollout.minibatches`` contiguous blocks of groups, one per optimizer step of
an epoch, and within a block the groups go round-robin to the data-parallel ranks; so the
global minibatch, and with the token-sum loss the update, is the same for every dp size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn

__all__ = [
    "Rollout",
    "RolloutSource",
    "exact_match_reward",
    "rank_group_indices",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class Rollout:
    """One sampled completion of a prompt.

    Attributes:
        group: the sample's group within this rank's share of the batch (0, 1, ...): the
            samples of one prompt; advantages are normalised within it.
        prompt_ids: the prompt's token ids (chat template and generation prompt applied).
        completion_ids: the sampled tokens (up to and including the end-of-turn token).
        reward: the completion's reward.
        advantages: per completion token, when the source gives them (else from the group's
            rewards).
        old_log_probs: per completion token, the log-probs it was sampled with (None: computed
            before the batch's first update).
    """

    group: int
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    reward: float
    advantages: tuple[float, ...] | None = None
    old_log_probs: tuple[float, ...] | None = None


class RolloutSource(Protocol):
    """Where the policy update's rollouts come from (the in-process sampler, a rollout file).

    Every rank calls :meth:`next_batch` together (a sampler's generation may be collective);
    the state goes into the run's checkpoints, so a resume draws the same batches.
    """

    def next_batch(self, model: nn.Module) -> list[Rollout]:
        """This rank's share of the next rollout batch, grouped (see the module docstring).

        Args:
            model: the current policy (unwrapped; the sampler generates with it).
        """
        ...

    def state_dict(self) -> dict[str, object]:
        """The position (and RNG) to continue from."""
        ...

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Continue from :meth:`state_dict`'s result."""
        ...


def rank_group_indices(groups: int, *, minibatches: int, dp_rank: int, dp_size: int) -> list[int]:
    """The indices (in the global batch) of the groups this rank trains, block after block.

    Block k (the groups ``[k * groups / minibatches, (k + 1) * groups / minibatches)``) is the
    k-th optimizer step's; within it the groups go round-robin to the ranks.

    Raises:
        ValueError: ``groups`` is not a multiple of ``minibatches * dp_size``.
    """
    if groups % (minibatches * dp_size):
        raise ValueError(
            f"rollout.groups_per_batch={groups} is not a multiple of rollout.minibatches * dp "
            f"= {minibatches} * {dp_size}; make it one (e.g. {minibatches * dp_size * 2})"
        )
    block = groups // minibatches
    return [k * block + i for k in range(minibatches) for i in range(dp_rank, block, dp_size)]


def exact_match_reward(answer: str, reference: str) -> float:
    """1.0 when the answer equals the reference (both stripped), else 0.0: the demo's reward."""
    return float(answer.strip() == reference.strip())
