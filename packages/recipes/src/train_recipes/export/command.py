"""`train-recipes export RUN|CHECKPOINT`: a saved Engine checkpoint -> a Hugging Face model folder.

Given a run folder, the newest complete checkpoint is exported (the final step is always saved,
so this is the trained model whatever ``train.export`` said); a checkpoint whose files fail
their checksum is skipped for the previous one, with a message.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from train_recipes.config.loader import config_from_dict
from train_recipes.config.sft import SFTConfig
from train_recipes.run.folder import CHECKPOINT_DIR, CONFIG_FILE, publish_dir

if TYPE_CHECKING:
    from train_engine import Engine

logger = logging.getLogger(__name__)


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory holding ``config.yaml`` and ``tokenizer/`` for a checkpoint folder."""
    for parent in (checkpoint, *checkpoint.parents):
        if (parent / "config.yaml").is_file() and (parent / "tokenizer").is_dir():
            return parent
    raise FileNotFoundError(
        f"no run directory (with config.yaml and tokenizer/) above {checkpoint}; "
        "pass a checkpoint written by `train-recipes sft`"
    )


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path | None = None) -> Path:
    """Load an SFT checkpoint into the recipe's model in one process and save it in HF format.

    Args:
        checkpoint: a run folder (its newest complete checkpoint is taken) or
            ``<run>/checkpoints/step_NNNNNN``.
        out_dir: destination; default ``<checkpoint>/hf_model``. Written beside and moved in
            whole, so a killed export never leaves a partial model where a loader would take it.

    Returns:
        The written directory (config.json, model.safetensors, tokenizer files).

    Raises:
        FileNotFoundError: no such checkpoint, or a run folder without a complete checkpoint.
    """
    from transformers import AutoTokenizer

    from train_engine import Engine
    from train_recipes.data.processors import load_processor
    from train_recipes.export.hf import export_hf
    from train_recipes.model.build import apply_lora, build_model
    from train_recipes.model.moe import convert_for_export
    from train_recipes.run.process_group import init_distributed
    from train_recipes.run.runtime import build_optimizer

    given = Path(checkpoint)
    if not given.is_dir():
        raise FileNotFoundError(f"checkpoint {given} does not exist")
    run_dir = run_dir_of(given)
    if (given / CONFIG_FILE).is_file():  # a run folder: its complete checkpoints, newest first
        from train_recipes.run.checkpoint_folder import complete_checkpoints

        candidates = complete_checkpoints(given)
        if not candidates:
            raise FileNotFoundError(
                f"{given} holds no complete checkpoint under {CHECKPOINT_DIR}/ (a run killed "
                "before its first save); continue it with `train-recipes sft --resume`"
            )
    else:
        candidates = [given]
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    config = config_from_dict(SFTConfig, raw)
    init_distributed(device_preference="cpu", cp=1)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    torch.manual_seed(config.train.seed)
    model = apply_lora(build_model(config, tokenizer), config)
    convert_for_export(model)  # a MoE run's checkpoint holds the converted layers
    # The run's own optimizer (MasterWeightAdamW for bf16 parameters, see optim.master_weights):
    # the checkpoint's optimizer state loads only into the optimizer that wrote it.
    optimizer, _ = build_optimizer(
        model, config.optim, device=torch.device("cpu"), total_steps=config.train.steps
    )
    engine = Engine(model, optimizer)
    ckpt = _load_newest(engine, candidates)
    out = Path(out_dir) if out_dir is not None else ckpt / "hf_model"
    processor = load_processor(config, tokenizer=tokenizer)
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    written = export_hf(model, processor, staging, is_main=True, lora_export=config.lora.export)
    assert written is not None
    return publish_dir(written, out)


def _load_newest(engine: Engine, candidates: list[Path]) -> Path:
    """Load the newest of ``candidates`` whose files pass their checksums; returns it."""
    from train_recipes.run.resume import load_newest

    loaded = load_newest(engine, candidates, say=logger.warning)
    if loaded is None:
        raise FileNotFoundError(
            f"no checkpoint of {', '.join(str(c) for c in candidates)} loads (see the "
            "checksum errors above)"
        )
    return loaded[0]
