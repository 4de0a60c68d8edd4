"""The in-process rollout source: the policy samples G completions per prompt on the ranks.

transformers' ``generate`` (sampling at ``rollout.temperature``, no top-k or top-p) on each
rank's share of the batch's prompts; the reward is exact match with the prompt's reference
answer. Sampling draws from torch's global generator, so the sampler keeps its own generator
state, swaps it in around ``generate`` and saves it: a resume samples the same completions.

# N samples (groups * G), P prompt length (left-padded), C completion length
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from train_recipes.config.grpo import RolloutConfig
from train_recipes.data.energon_api import ChatMessage, ChatRow
from train_recipes.grpo.rollouts import Rollout, exact_match_reward, rank_group_indices

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from train_recipes.run.process_group import RankContext

__all__ = ["PolicySampler", "prompt_ids"]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, row: ChatRow) -> tuple[int, ...]:
    """The chat's messages before the reference answer, rendered for generation."""
    messages = cast("list[ChatMessage]", row["messages"])[:-1]
    ids = tokenizer.apply_chat_template(
        cast("list[dict[str, str]]", messages),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return tuple(cast("list[int]", ids))


def _answer(row: ChatRow) -> str:
    return cast(str, cast("list[ChatMessage]", row["messages"])[-1]["content"])


class PolicySampler:
    """Samples this rank's groups of each rollout batch from the policy (a :class:`RolloutSource`).

    Every rank walks the same seeded permutation of the prompts; a batch takes the next
    ``groups_per_batch`` of them and each rank samples its groups
    (:func:`train_recipes.grpo.rollouts.rank_group_indices`) with its own generator.

    Args:
        prompts: chats whose last message is the reference answer.
        tokenizer: the policy's tokenizer (chat template, end-of-turn and padding ids).
        rollout: the rollout settings (groups, G, temperature, budget, minibatches).
        ctx: this rank's place in the mesh.
        seed: ``train.seed``: the prompt order, and (plus the rank) the sampling generator.
        max_length: prompt plus completion tokens at most.
        synced: every rank's forward is collective (FSDP2, tp): ranks generate in lock-step.
    """

    def __init__(
        self,
        prompts: Sequence[ChatRow],
        tokenizer: PreTrainedTokenizerBase,
        *,
        rollout: RolloutConfig,
        ctx: RankContext,
        seed: int,
        max_length: int,
        synced: bool = False,
    ) -> None:
        if not prompts:
            raise ValueError("the GRPO sampler needs prompts; data.prompts has no rows")
        self._prompts = list(prompts)
        self._tokenizer = tokenizer
        self._rollout = rollout
        self._ctx = ctx
        self._max_length = max_length
        self._synced = synced
        self._order = torch.randperm(
            len(self._prompts), generator=torch.Generator().manual_seed(seed)
        ).tolist()
        self._cursor = 0  # groups of the permutation drawn so far (all ranks)
        self._cpu_rng = torch.Generator().manual_seed(seed * 1009 + 1 + ctx.rank).get_state()
        self._cuda_rng: Tensor | None = None
        if ctx.device.type == "cuda":
            with torch.random.fork_rng(devices=[ctx.device]):
                torch.cuda.manual_seed(seed * 1009 + 1 + ctx.rank)
                self._cuda_rng = torch.cuda.get_rng_state(ctx.device)

    def state_dict(self) -> dict[str, object]:
        """The prompt position and the generator states."""
        return {"cursor": self._cursor, "cpu_rng": self._cpu_rng, "cuda_rng": self._cuda_rng}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Continue from :meth:`state_dict`'s result."""
        self._cursor = cast(int, state["cursor"])
        self._cpu_rng = cast(Tensor, state["cpu_rng"])
        self._cuda_rng = cast("Tensor | None", state["cuda_rng"])

    def next_batch(self, model: nn.Module) -> list[Rollout]:
        """Sample G completions for each of this rank's prompts of the next batch."""
        rollout, ctx = self._rollout, self._ctx
        groups = rank_group_indices(
            rollout.groups_per_batch,
            minibatches=rollout.minibatches,
            dp_rank=ctx.dp_rank,
            dp_size=ctx.dp_size,
        )
        n = len(self._order)
        rows = [self._prompts[self._order[(self._cursor + g) % n]] for g in groups]
        self._cursor += rollout.groups_per_batch
        prompts = [prompt_ids(self._tokenizer, row) for row in rows]
        for row, ids in zip(rows, prompts, strict=True):
            if len(ids) + rollout.max_new_tokens > self._max_length:
                raise ValueError(
                    f"a prompt of {len(ids)} tokens plus rollout.max_new_tokens="
                    f"{rollout.max_new_tokens} exceeds data.max_length={self._max_length} "
                    f"({row['messages']!r}); raise data.max_length"
                )
        G = rollout.group_size
        completions = self._generate(model, [p for p in prompts for _ in range(G)])
        tokenizer = self._tokenizer
        out = []
        for i, completion in enumerate(completions):
            group = i // G
            text = tokenizer.decode(list(completion), skip_special_tokens=True)
            out.append(
                Rollout(
                    group=group,
                    prompt_ids=prompts[group],
                    completion_ids=completion,
                    reward=exact_match_reward(cast(str, text), _answer(rows[group])),
                )
            )
        return out

    def _generate(self, model: nn.Module, prompts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Sampled completions (up to and including the end-of-turn token) of ``prompts``."""
        from transformers import GenerationConfig

        tokenizer, device = self._tokenizer, self._ctx.device
        end_id = cast(int, tokenizer.eos_token_id)
        pad_id = cast(int, tokenizer.pad_token_id)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where sampling starts
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        generation = GenerationConfig(
            do_sample=True,
            temperature=self._rollout.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=self._rollout.max_new_tokens,
            pad_token_id=pad_id,
            eos_token_id=end_id,
        )
        was_training = model.training
        model.eval()
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.set_rng_state(self._cpu_rng)
            if self._cuda_rng is not None:
                torch.cuda.set_rng_state(self._cuda_rng, device)
            out = model.generate(  # type: ignore[operator]
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=generation,
                synced_gpus=self._synced,
            )
            self._cpu_rng = torch.get_rng_state()
            if self._cuda_rng is not None:
                self._cuda_rng = torch.cuda.get_rng_state(device)
        model.train(was_training)
        completions = []
        for row in out[:, width:].tolist():
            if end_id in row:
                row = row[: row.index(end_id) + 1]
            completions.append(tuple(row))
        return completions
