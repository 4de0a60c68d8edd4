"""Export a peft LoRA model that may be sharded by FSDP2: merged, or the adapter alone.

The live model's weights may be DTensor shards, which peft's merge and save cannot read. The
full state dict is gathered to rank 0 on the host (collective; LoRA models are exported whole,
as before), loaded into a host copy of the same peft model built from the live model's own
configs, and peft's ``merge_and_unload`` / ``save_pretrained`` write it from there. The live
model keeps its adapters and its sharding.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from peft import PeftMixedModel, PeftModel
    from torch import nn
    from transformers import PreTrainedModel

    from train_recipes.data.processors import Processor

__all__ = ["export_lora"]

logger = logging.getLogger(__name__)


def _host_copy(peft_model: PeftModel, state: dict[str, torch.Tensor]) -> PeftModel | PeftMixedModel:
    """A CPU peft model of the same classes and configs, holding ``state``."""
    from peft import get_peft_model

    base = cast("PreTrainedModel", peft_model.get_base_model())  # the transformers model
    with torch.device("cpu"):
        # nn.Module: mypy reads PreTrainedModel.to (wrapped by transformers) as taking a model
        fresh: nn.Module = type(base)(base.config)
    fresh = fresh.to(next(iter(state.values())).dtype) if state else fresh
    copy = get_peft_model(fresh, peft_model.peft_config["default"])
    missing, unexpected = copy.load_state_dict(state, strict=False)
    # Tied aliases are absent from a consolidated state dict; anything else is a bug.
    tied = {
        name
        for name in missing
        if name.endswith("lm_head.weight") and base.config.tie_word_embeddings
    }
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"the LoRA host copy does not match the live model: missing "
            f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    return copy


def export_lora(
    model: PeftModel,
    tokenizer: Processor,
    out_dir: str | Path,
    *,
    is_main: bool,
    lora_export: str,
) -> Path | None:
    """Write ``model`` (a peft model, plain or FSDP2) merged or as its adapter on rank 0.

    Collective when a process group is initialised: every rank must call it.

    Args:
        model: the peft model (unwrapped from DDP).
        tokenizer: the tokenizer or processor, saved beside the weights.
        out_dir: the destination folder.
        is_main: this rank writes the files (rank 0).
        lora_export: "merged" (a plain transformers folder) or "adapter"
            (``adapter_config.json`` + ``adapter_model.safetensors``).

    Returns:
        The folder on rank 0, None elsewhere.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not is_main:
        return None
    copy = _host_copy(model, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if lora_export == "adapter":
        copy.save_pretrained(str(out), safe_serialization=True)  # peft's takes a str
    else:
        copy.merge_and_unload().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    logger.info("exported the LoRA model (%s) to %s", lora_export, out)
    return out
