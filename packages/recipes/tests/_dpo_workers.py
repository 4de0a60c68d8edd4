"""Rank functions and inputs of the DPO recipe's tests (a light module: ranks re-import it)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from _recipes_workers import metric_rows

# A tiny random-init policy, every step logged, nothing else written: the tests add their own.
QUIET_DPO = (
    "model.tiny.hidden_size=32",
    "train.log_every=1",
    "train.checkpoint_every=0",
    "train.eval_samples=0",
    "train.export=false",
    "train.tensorboard=false",
    "train.device=cpu",
    "data.shuffle=false",
    "optim.lr=1e-3",
    "optim.warmup_steps=0",
    "loss.beta=0.5",
)


def write_pairs(path: Path, n: int, *, seed: int = 0) -> Path:
    """``n`` addition pairs (the right sum against a near miss) as a pairs JSONL file."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randrange(100), rng.randrange(100)
            wrong = a + b + rng.choice((-10, -1, 1, 10)) if a + b >= 10 else a + b + 1
            row = {
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "chosen": str(a + b),
                "rejected": str(wrong),
            }
            f.write(json.dumps(row) + "\n")
    return path


def run_dpo_on_rank(
    rank: int, world_size: int, overrides: list[str], resume: bool = False
) -> dict[str, Any]:
    """Run the DPO recipe on this rank; rank 0 returns the metric rows and the result."""
    from train_recipes.config.dpo import DPOConfig, validate_dpo
    from train_recipes.config.loader import load_config
    from train_recipes.dpo.recipe import run_dpo

    config = load_config(DPOConfig, None, overrides)
    validate_dpo(config, world_size=world_size)
    result = run_dpo(config, resume=resume)
    if rank != 0:
        return {}
    return {
        "rows": metric_rows(config.train.output_dir),
        "accuracy_before": result.accuracy_before,
        "accuracy_after": result.accuracy_after,
    }


def losses_by_step(rows: list[dict[str, Any]]) -> dict[int, float]:
    """{step: loss}; a step logged twice (before and after a resume) keeps its last row."""
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
