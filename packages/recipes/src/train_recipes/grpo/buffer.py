"""The rollout buffer: one rollout batch as training tensors, used for several optimizer steps.

Each sample is one row, prompt then completion, right-padded; its labels are shifted (position
t holds token t+1) and only the completion's tokens are trained. The buffer lives across the
optimizer steps of a batch (``update_epochs * minibatches`` of them) and goes into the
checkpoint with them, so a resume in the middle of a batch continues it.

# N samples on this rank, S row length
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import cast

import torch
from torch import Tensor

from train_recipes.grpo.rollouts import Rollout
from train_recipes.loss.policy_loss import PolicyTokens, group_advantages

__all__ = ["RolloutBuffer", "collate_rollouts", "minibatch_tokens"]

IGNORE_INDEX = -100


@dataclass(kw_only=True, slots=True)
class RolloutBuffer:
    """This rank's samples of one rollout batch as tensors (on the host until a step uses them).

    Attributes:
        input_ids: [N, S] prompt and completion, right-padded.
        position_ids: [N, S] 0, 1, ... per row.
        labels: [N, S] the next token where it is a completion token, else -100.
        advantages: [N, S] each trained token's advantage (0 elsewhere).
        rewards: [N] each sample's reward.
        groups: [N] each sample's group (0, 1, ... in order).
        old_log_p: [N, S] the sampling log-probs; None until computed (or on-policy).
        ref_log_p: [N, S] the reference's log-probs; None without a KL term.
        steps_done: optimizer steps already taken on this batch.
    """

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    advantages: Tensor
    rewards: Tensor
    groups: Tensor
    old_log_p: Tensor | None = None
    ref_log_p: Tensor | None = None
    steps_done: int = 0

    def rows_of(self, index: int, count: int) -> Tensor:
        """[N] bool: the rows of the ``index``-th of ``count`` contiguous blocks of groups."""
        per_block = (int(self.groups.max()) + 1) // count
        return (self.groups // per_block) == index

    def minibatch(self, index: int, count: int, device: torch.device) -> dict[str, Tensor]:
        """The rows of :meth:`rows_of` on ``device``.

        Keys: ``input_ids``, ``position_ids``, ``labels``, ``advantages`` and, when present,
        ``old_log_p`` and ``ref_log_p``.
        """
        part = self.rows_of(index, count)
        out = {
            "input_ids": self.input_ids[part],
            "position_ids": self.position_ids[part],
            "labels": self.labels[part],
            "advantages": self.advantages[part],
        }
        if self.old_log_p is not None:
            out["old_log_p"] = self.old_log_p[part]
        if self.ref_log_p is not None:
            out["ref_log_p"] = self.ref_log_p[part]
        return {k: v.to(device) for k, v in out.items()}

    def state_dict(self) -> dict[str, Tensor | int | None]:
        """The tensors (on the host) and the step count."""
        return {
            f.name: (
                v.cpu() if isinstance(v := getattr(self, f.name), Tensor) else cast("int | None", v)
            )
            for f in fields(self)
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor | int | None]) -> RolloutBuffer:
        """The buffer :meth:`state_dict` saved."""
        return cls(**state)  # type: ignore[arg-type]


def minibatch_tokens(batch: dict[str, Tensor]) -> PolicyTokens:
    """The per-token constants of a :meth:`RolloutBuffer.minibatch`."""
    return PolicyTokens(
        advantages=batch["advantages"],
        old_log_p=batch.get("old_log_p"),
        ref_log_p=batch.get("ref_log_p"),
    )


def collate_rollouts(rollouts: list[Rollout], *, pad_id: int, eps: float) -> RolloutBuffer:
    """Rows, shifted labels and per-token advantages of this rank's rollouts.

    A sample's advantage is its own (``Rollout.advantages``) or, from the rewards, its
    group-normalised one (:func:`train_recipes.loss.policy_loss.group_advantages`), on every
    completion token. Old log-probs given by the source are placed on the same positions.

    Args:
        rollouts: this rank's share of a batch.
        pad_id: the padding token.
        eps: added to each group's reward standard deviation.
    """
    n = len(rollouts)
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    advantages = torch.zeros((n, width), dtype=torch.float32)
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    groups = torch.tensor([r.group for r in rollouts], dtype=torch.long)
    from_rewards = group_advantages(rewards, groups, eps=eps)
    given_old = [r.old_log_probs is not None for r in rollouts]
    if any(given_old) and not all(given_old):
        raise ValueError(
            "some rollouts of the batch carry old_log_probs and some do not; give them for "
            "every row of the file or for none"
        )
    old = torch.zeros((n, width), dtype=torch.float32) if all(given_old) else None
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        input_ids[i, : p + c] = torch.tensor(r.prompt_ids + r.completion_ids)
        # Position t predicts token t+1: the completion's tokens are the labels of p-1 ... p+c-2.
        trained = slice(p - 1, p + c - 1)
        labels[i, trained] = torch.tensor(r.completion_ids)
        if r.advantages is not None:
            advantages[i, trained] = torch.tensor(r.advantages)
        else:
            advantages[i, trained] = from_rewards[i]
        if old is not None:
            old[i, trained] = torch.tensor(cast("tuple[float, ...]", r.old_log_probs))
    position_ids = torch.arange(width).expand(n, width).contiguous()
    return RolloutBuffer(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        advantages=advantages,
        rewards=rewards,
        groups=groups,
        old_log_p=old,
    )
