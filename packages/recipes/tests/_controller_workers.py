"""Rank functions for the colocated-loader and controller tests (a light module: ranks
re-import it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def metrics_losses(output_dir: str | Path) -> dict[int, float]:
    """``step -> loss`` from a run's metrics.jsonl (the last row of a step wins)."""
    rows = [json.loads(x) for x in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r}


def run_sft_plane_on_rank(rank: int, world_size: int, overrides: list[str]) -> dict[str, Any]:
    """Run the SFT recipe (SPMD) on this rank; every rank returns its data plane and the
    loaders it built, rank 0 also the logged losses."""
    from train_recipes.config import SFTConfig, load_config, validate_sft
    from train_recipes.sft.run import run_sft

    config = load_config(SFTConfig, None, overrides)
    validate_sft(config, world_size=world_size)
    result = run_sft(config)
    assert result.data_plane is not None
    out: dict[str, Any] = {
        "plane": result.data_plane.state_dict(),
        "loaders_built": result.loaders_built,
    }
    if rank == 0:
        out["losses"] = metrics_losses(config.train.output_dir)
    return out


def loader_sample_ids(
    dataset: str, *, dp_rank: int, dp_size: int, shards: int, batches: int, cp: int
) -> list[list[str]]:
    """The source ids of the first ``batches`` batches of an energon-sft loader built directly
    (not through the recipe) as the recipe builds replica ``dp_rank``'s."""
    from energon_sft import SFTTaskEncoder, build_sft_loader
    from train_recipes.data.demo import build_char_tokenizer

    encoder = SFTTaskEncoder(
        build_char_tokenizer(),
        model_family="text",
        max_length=32,
        train_on="all_assistant",
        pad_to_multiple_of=2 * cp,
    )
    loader = build_sft_loader(
        dataset,
        encoder=encoder,
        batch_size=8,
        dp_rank=dp_rank,
        dp_world_size=dp_size,
        num_workers=0,
        seed=0,
        shuffle=False,
        num_logical_shards=shards,
    )
    out: list[list[str]] = []
    with loader:
        for batch in loader:
            out.append(list(batch.source_ids))
            if len(out) == batches:
                break
    return out
