"""`train-recipes export CHECKPOINT`: a saved Engine checkpoint -> a Hugging Face model folder."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import yaml

from train_recipes.config import SFTConfig, config_from_dict

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
        checkpoint: ``<run>/checkpoints/step_NNNNNN``.
        out_dir: destination; default ``<checkpoint>/hf_model``.

    Returns:
        The written directory (config.json, model.safetensors, tokenizer files).
    """
    from transformers import AutoTokenizer

    from train_engine import Engine
    from train_recipes._dist import init_distributed
    from train_recipes.modeling import (
        LocalProcessor,
        apply_lora,
        build_model,
        demo_image_processor,
        export_hf,
        is_vlm,
    )

    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint {ckpt} does not exist")
    run_dir = run_dir_of(ckpt)
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    config = config_from_dict(SFTConfig, raw)
    init_distributed(device_preference="cpu", cp=1)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    torch.manual_seed(config.train.seed)
    model = apply_lora(build_model(config, tokenizer), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr)
    engine = Engine(model, optimizer)
    engine.load_checkpoint(ckpt)
    out = Path(out_dir) if out_dir is not None else ckpt / "hf_model"
    processor: Any = tokenizer
    if is_vlm(config):
        if config.model.path is None:
            processor = LocalProcessor(tokenizer, demo_image_processor())
        else:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(config.model.path)
    written = export_hf(model, processor, out, is_main=True, lora_export=config.lora.export)
    assert written is not None
    return written
