"""Rank functions and inputs of the GRPO tests (a light module: ranks re-import it)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from _recipes_workers import logged_losses, metric_rows

# A short quiet CPU run of the tiny random-init policy on the demo's addition prompts.
QUIET_GRPO_RUN = (
    "train.log_every=1",
    "train.checkpoint_every=0",
    "train.eval_samples=0",
    "train.tensorboard=false",
    "train.export=false",
    "train.device=cpu",
    "data.demo_train_size=64",
    "data.demo_eval_size=8",
    "rollout.groups_per_batch=4",
    "rollout.group_size=4",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "optim.min_lr_ratio=1.0",
)


def run_grpo_on_rank(
    rank: int, world_size: int, overrides: list[str], resume: bool = False
) -> dict[str, Any]:
    """Run the GRPO recipe on this rank; rank 0 returns the metric rows by step."""
    from train_recipes.config.grpo import GRPOConfig
    from train_recipes.config.grpo_validation import validate_grpo
    from train_recipes.config.loader import load_config
    from train_recipes.grpo.recipe import run_grpo

    config = load_config(GRPOConfig, None, overrides)
    validate_grpo(config, world_size=world_size)
    run_grpo(config, resume=resume)
    if rank != 0:
        return {}
    rows = metric_rows(config.train.output_dir)
    return {"losses": logged_losses(rows), "rows": {r["step"]: r for r in rows if "loss" in r}}


def write_rollout_file(path: Path, *, groups: int, group_size: int, seed: int = 0) -> Path:
    """Rollouts of the demo's addition prompts with random digit completions and 0/1 rewards,
    as an external generator would write them (``prompt_ids`` and ``messages`` rows mixed)."""
    from train_recipes.data.demo import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    rng = random.Random(seed)
    end = tokenizer.eos_token_id
    with path.open("w") as f:
        for g in range(groups):
            a, b = rng.randrange(100), rng.randrange(100)
            messages = [{"role": "user", "content": f"{a}+{b}="}]
            prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for s in range(group_size):
                answer = str(a + b) if rng.random() < 0.5 else str(rng.randrange(200))
                completion = [*tokenizer.encode(answer, add_special_tokens=False), end]
                row: dict[str, Any] = {"group": f"q{g}", "completion_ids": completion}
                row["reward"] = float(answer == str(a + b))
                if s % 2:
                    row["messages"] = messages
                else:
                    row["prompt_ids"] = list(prompt)
                f.write(json.dumps(row) + "\n")
    return path
