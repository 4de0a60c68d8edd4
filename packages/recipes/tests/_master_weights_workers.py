"""Rank functions of the master-weights recipe tests (a light module: ranks re-import it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def run_and_describe(
    rank: int, world_size: int, overrides: list[str], probe: list[list[int]], resume: bool = False
) -> dict[str, Any]:
    """One SFT run (``resume``: from the folder's newest checkpoint) on one rank: the logged
    losses, the probe's logits, the trained parameters' dtypes and a copy of them, and the
    optimizer state keys the newest checkpoint holds (with their dtypes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from _recipes_workers import logged_losses, metric_rows
    from train_recipes.config import SFTConfig, load_config, validate_sft
    from train_recipes.run.checkpoint_folder import complete_checkpoints
    from train_recipes.sft.run import run_sft

    config = load_config(SFTConfig, None, overrides)
    validate_sft(config, world_size=world_size)
    result = run_sft(config, resume=resume)
    model = result.model
    with torch.no_grad():
        model.eval()
        logits = model(input_ids=torch.tensor(probe)).logits
    out = Path(config.train.output_dir)
    newest = complete_checkpoints(out)[0]
    metadata = FileSystemReader(str(newest / "model_optim")).read_metadata().state_dict_metadata
    saved = {
        key: str(meta.properties.dtype).removeprefix("torch.")
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    return {
        "wrapper": type(model).__name__,
        "losses": logged_losses(metric_rows(out)),
        "logits": logits,
        "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "saved": saved,
        "export_dir": str(result.export_dir),
        "checkpoint": str(newest),
    }


def export_on_rank(rank: int, world_size: int, checkpoint: str, out_dir: str) -> str:
    """``train-recipes export CHECKPOINT --out OUT_DIR`` in this rank's process."""
    from train_recipes.export.command import export_checkpoint

    return str(export_checkpoint(checkpoint, out_dir))
