"""How much disk a run's checkpoints need, estimated before launch from the model's shape.

One checkpoint holds the parameters at ``model.dtype``, the optimizer's state and a little
per-rank state (RNG, loader position, data-plane records):

- parameters are counted without reading a weight: from the safetensors headers of
  ``model.path`` (8 bytes of length and a JSON header per file), from ``model.tiny`` for the
  built-in model, or, for a folder without safetensors files (``pytorch_model.bin``), by
  building its config.json on the meta device. Tied input and output embeddings are stored
  once by ``save_pretrained`` but twice by the distributed checkpoint: counted twice.
- the optimizer's state (``train.checkpoint_optimizer``): AdamW's two moments per trainable
  parameter, fp32 with master weights plus the fp32 master of each bf16 weight (12 bytes per
  bf16 parameter), in the parameters' dtype without them. Under LoRA only the adapters train;
  their state is not counted (well under 1% of the weights).
- each saved tensor costs about 3 KiB more (DCP writes every tensor as a small zip record).

At a save the new checkpoint is written before the oldest kept one is removed, so a run that
keeps ``k`` checkpoints needs room for ``k + 1`` at its peak (for all of them with ``k = 0``),
and the Hugging Face export comes on top of the kept ones at the end. Checkpoints already in
the run folder (a resume) count as space in use.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from train_recipes.config.sft import SFTConfig
from train_recipes.run.folder import CHECKPOINT_DIR
from train_recipes.run.safetensors_header import read_safetensors_header

__all__ = [
    "CheckpointSize",
    "StorageNeed",
    "checkpoint_size",
    "size_text",
    "storage_need",
]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# DCP's per-tensor overhead (a zip record around each torch.save; measured 2.9 KiB).
_PER_TENSOR = 3 << 10
# Per rank and checkpoint: RNG states, the loader's position, the loop's records (about 15 KiB
# for the demo), besides the data plane's records.
_PER_RANK = 32 << 10
# A data-plane record per sample trained (its id, pickled), per rank's copy.
_PER_SAMPLE = 16


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointSize:
    """The estimated size of one checkpoint, in bytes.

    Attributes:
        weights: the parameters at ``model.dtype`` (tied embeddings twice), with DCP's
            per-tensor overhead.
        optimizer: the optimizer's state (0 with ``train.checkpoint_optimizer=false``).
        optimizer_if_saved: what the optimizer's state weighs when it is saved.
        extra: per-rank state (RNG, loader, data plane).
        export: the Hugging Face export (0 when ``train.export`` is off or LoRA exports the
            adapter only).
        optimizer_name: "MasterWeightAdamW" or "AdamW", as the run will build it.
    """

    weights: int
    optimizer: int
    optimizer_if_saved: int
    extra: int
    export: int
    optimizer_name: str

    @property
    def total(self) -> int:
        """One checkpoint as the config saves it."""
        return self.weights + self.optimizer + self.extra

    @property
    def weights_only(self) -> int:
        """One checkpoint with ``train.checkpoint_optimizer=false``."""
        return self.weights + self.extra


@dataclass(kw_only=True, slots=True, frozen=True)
class StorageNeed:
    """Free bytes the run needs, and how that follows from the checkpoints it keeps.

    Attributes:
        free_needed: bytes that must be free on ``train.output_dir``'s filesystem.
        at_peak: checkpoints on disk at the fullest moment (kept ones plus the one written).
        existing: bytes of the run's checkpoints already on disk (a resume).
    """

    free_needed: int
    at_peak: int
    existing: int


def _safetensors_tensors(folder: Path) -> dict[str, int] | None:
    """``name -> element count`` of every tensor in the folder's safetensors files."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    counts: dict[str, int] = {}
    for path in files:
        for name, entry in read_safetensors_header(path).tensors.items():
            counts[name] = math.prod(entry["shape"])
    return counts


def _tied(folder: Path) -> bool:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def _meta_tensors(config: SFTConfig, folder: Path) -> dict[str, int]:
    """Build ``folder``'s config on the meta device (no weights read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from train_recipes.data.energon_api import is_vlm

    hf_config = AutoConfig.from_pretrained(folder)
    auto = AutoModelForImageTextToText if is_vlm(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    # Named with duplicates: DCP saves a tied weight under both names.
    return {name: p.numel() for name, p in model.named_parameters(remove_duplicate=False)}


def _tiny_tensors(config: SFTConfig) -> dict[str, int]:
    """The built-in Llama-style model of ``model.tiny`` (the demo tokenizer's vocabulary)."""
    from train_recipes.data.demo import SPECIAL_TOKENS, VISION_TOKENS

    tiny = config.model.tiny
    vocab = len(SPECIAL_TOKENS) + (127 - 32) + len(VISION_TOKENS)  # the printable ASCII
    hidden, inner = tiny.hidden_size, tiny.intermediate_size or 3 * tiny.hidden_size
    kv = hidden // tiny.num_heads * tiny.num_kv_heads
    layer = {"q": hidden * hidden, "k": hidden * kv, "v": hidden * kv, "o": hidden * hidden}
    layer |= {"gate": hidden * inner, "up": hidden * inner, "down": inner * hidden}
    layer |= {"norm1": hidden, "norm2": hidden}
    tensors = {f"layers.{i}.{k}": n for i in range(tiny.num_layers) for k, n in layer.items()}
    # The output projection is a tensor of its own in the checkpoint, tied or not.
    return tensors | {"embed": vocab * hidden, "norm": hidden, "lm_head": vocab * hidden}


def _parameter_tensors(config: SFTConfig) -> tuple[dict[str, int], int] | None:
    """The tensors a checkpoint saves and the trainable elements whose optimizer state it saves.

    Returns:
        (``name -> elements``, trainable elements), or None when the model folder holds no
        weights to count.
    """
    if config.model.path is None:
        tensors = _tiny_tensors(config)
        trained = sum(tensors.values()) - (
            tensors["embed"] if config.model.tiny.tie_word_embeddings else 0
        )
    else:
        folder = Path(config.model.path)
        found = _safetensors_tensors(folder)
        if found is not None:
            tensors = dict(found)
            trained = sum(tensors.values())
            embed = [n for n in tensors if n.endswith("embed_tokens.weight")]
            if _tied(folder) and embed and not any(n.endswith("lm_head.weight") for n in tensors):
                tensors["lm_head.weight (tied)"] = tensors[embed[0]]
        elif any(folder.glob("*.bin")):
            tensors = _meta_tensors(config, folder)
            trained = sum(tensors.values())  # a tied copy's state is kept once: close enough
        else:
            return None
    if config.lora.enabled:
        trained = 0  # adapters only: their state is a small fraction of the weights
    return tensors, trained


def checkpoint_size(config: SFTConfig, *, world_size: int) -> CheckpointSize | None:
    """One checkpoint of this config, in bytes (None when the model folder has no weights).

    Args:
        config: the run's config.
        world_size: ranks of the job (each writes its own small state).
    """
    counted = _parameter_tensors(config)
    if counted is None:
        return None
    tensors, trained = counted
    width = _DTYPE_BYTES[config.model.dtype]
    master = config.optim.master_weights
    if master is None:  # as runtime.choose_optimizer resolves it (peft's adapters are fp32)
        master = config.model.dtype == "bfloat16" and not config.lora.enabled
    if master:
        per_param, states, name = 8 + (4 if width < 4 else 0), 4, "MasterWeightAdamW"
    else:
        per_param, states, name = 2 * width, 3, "AdamW"
    optimizer = trained * per_param + (len(tensors) * states * _PER_TENSOR if trained else 0)
    steps = config.train.steps if config.train.epochs is None else 0
    samples = steps * config.data.micro_batch_size * config.train.gradient_accumulation_steps
    weights = sum(tensors.values()) * width + len(tensors) * _PER_TENSOR
    export = 0
    if config.train.export and not (config.lora.enabled and config.lora.export == "adapter"):
        export = sum(tensors.values()) * width
    return CheckpointSize(
        weights=weights,
        optimizer=optimizer if config.train.checkpoint_optimizer else 0,
        optimizer_if_saved=optimizer,
        extra=world_size * (_PER_RANK + samples * _PER_SAMPLE),
        export=export,
        optimizer_name=name,
    )


def _saves(config: SFTConfig) -> int | None:
    """Checkpoints the run writes (None: unknown, the length comes from ``train.epochs``)."""
    train = config.train
    if train.epochs is not None:
        return None
    every = train.checkpoint_every
    if every <= 0:
        return 1  # the last step is always saved
    return train.steps // every + (1 if train.steps % every else 0)


def _existing(config: SFTConfig) -> tuple[int, int]:
    """(count, bytes) of the complete checkpoints already in the run folder."""
    root = Path(config.train.output_dir) / CHECKPOINT_DIR
    found = [p for p in root.glob("step_*") if (p / "COMPLETE").is_file()] if root.is_dir() else []
    size = sum(f.stat().st_size for p in found for f in p.rglob("*") if f.is_file())
    return len(found), size


def storage_need(config: SFTConfig, size: CheckpointSize, *, checkpoint: int) -> StorageNeed:
    """The free space the run needs for checkpoints of ``checkpoint`` bytes each.

    Args:
        config: the run's config (``keep_checkpoints``, ``checkpoint_every``, ``steps``).
        size: the estimate of one checkpoint (its export is added at the end).
        checkpoint: the size of one checkpoint to plan for (``size.total`` or an alternative).
    """
    keep = config.train.keep_checkpoints
    have, existing = _existing(config)
    saves = _saves(config)
    if saves is None:  # unknown length: at least the kept ones and the one being written
        saves = keep + 1 if keep > 0 else 1
    cap = keep if keep > 0 else have + saves
    at_peak = min(cap, have + saves - 1) + 1
    at_end = min(cap, have + saves) * checkpoint + size.export
    need = max(at_peak * checkpoint, at_end) - existing
    return StorageNeed(free_needed=max(need, checkpoint), at_peak=at_peak, existing=existing)


def size_text(size: int) -> str:
    """``1.5 MiB``, ``104.3 GiB`` (``KiB`` under a MiB)."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size / 1024:.1f} KiB"
