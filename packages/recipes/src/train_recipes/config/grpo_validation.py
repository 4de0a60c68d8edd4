"""Validation of the GRPO config: its own keys, then the policy's as the SFT recipe checks them.

Pure Python: a config is rejected, naming the offending key, before any rank starts. The
rollout file's rows are checked by the launcher (they need the tokenizer).
"""

from __future__ import annotations

import math
from pathlib import Path

from train_recipes.config.grpo import GRPOConfig, policy_sft_config
from train_recipes.config.loader import ConfigError
from train_recipes.config.validation import validate_sft

__all__ = ["validate_grpo"]


def _positive(key: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(key, f"must be a finite number > 0, got {value}")


def _not_negative(key: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(key, f"must be a finite number >= 0, got {value}")


def validate_grpo(config: GRPOConfig, *, world_size: int) -> None:
    """Check a GRPO config for a job of ``world_size`` ranks.

    Raises:
        ConfigError: naming the key, what was expected and the fix.
    """
    parallel, rollout, loss = config.parallel, config.rollout, config.loss
    if parallel.cp != 1 or parallel.tp != 1:
        key = "parallel.cp" if parallel.cp != 1 else "parallel.tp"
        raise ConfigError(
            key, "the grpo recipe runs data parallelism only (ddp or fsdp2) so far; set it to 1"
        )
    if config.model.backend != "hf":
        raise ConfigError("model.backend", "the grpo recipe trains transformers models: set 'hf'")
    for key, count in (
        ("rollout.groups_per_batch", rollout.groups_per_batch),
        ("rollout.group_size", rollout.group_size),
        ("rollout.max_new_tokens", rollout.max_new_tokens),
        ("rollout.update_epochs", rollout.update_epochs),
        ("rollout.minibatches", rollout.minibatches),
    ):
        if count < 1:
            raise ConfigError(key, f"must be >= 1, got {count}")
    if rollout.source == "sampler" and rollout.group_size < 2:
        raise ConfigError(
            "rollout.group_size",
            f"{rollout.group_size} sample per prompt has no group to compare with (its "
            "advantage is 0); use 2 or more (GRPO uses 8-64)",
        )
    dp = world_size
    if rollout.groups_per_batch % (rollout.minibatches * dp):
        raise ConfigError(
            "rollout.groups_per_batch",
            f"{rollout.groups_per_batch} groups do not split into rollout.minibatches="
            f"{rollout.minibatches} steps over {dp} data-parallel ranks; use a multiple of "
            f"{rollout.minibatches * dp}",
        )
    _positive("rollout.temperature", rollout.temperature)
    if rollout.source == "file":
        if rollout.path is None:
            raise ConfigError("rollout.path", "rollout.source 'file' needs the rollout JSONL")
        if not Path(rollout.path).is_file():
            raise ConfigError("rollout.path", f"{rollout.path} does not exist")
    elif rollout.path is not None:
        raise ConfigError("rollout.path", "is only read with rollout.source: file; set it too")
    if not 0 <= loss.eps_low < 1:
        raise ConfigError("loss.eps_low", f"must be in [0, 1), got {loss.eps_low}")
    _not_negative("loss.eps_high", loss.eps_high)
    _not_negative("loss.kl_coef", loss.kl_coef)
    _not_negative("loss.entropy_coef", loss.entropy_coef)
    _positive("loss.advantage_eps", loss.advantage_eps)
    data = config.data
    for key, path in (("data.prompts", data.prompts), ("data.eval_path", data.eval_path)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(key, f"{path} does not exist")
    if data.prompts is None and data.eval_path is not None:
        raise ConfigError("data.eval_path", "is read with data.prompts; the demo has its own")
    if rollout.max_new_tokens >= data.max_length:
        raise ConfigError(
            "rollout.max_new_tokens",
            f"{rollout.max_new_tokens} leaves no room for a prompt within data.max_length="
            f"{data.max_length}; raise data.max_length",
        )
    train = config.train
    for key, count, low in (
        ("train.steps", train.steps, 1),
        ("train.log_every", train.log_every, 1),
        ("train.loss_window", train.loss_window, 1),
        ("train.checkpoint_every", train.checkpoint_every, 0),
        ("train.keep_checkpoints", train.keep_checkpoints, 0),
        ("train.eval_samples", train.eval_samples, 0),
        ("train.eval_max_new_tokens", train.eval_max_new_tokens, 1),
    ):
        if count < low:
            raise ConfigError(key, f"must be >= {low}, got {count}")
    # The policy (model, optimizer, parallelism, LoRA, MoE) as the SFT recipe checks it.
    validate_sft(policy_sft_config(config), world_size=world_size)
