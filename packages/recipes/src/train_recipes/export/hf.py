"""Write the trained model in Hugging Face format (plain, converted MoE, or LoRA)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
from torch import nn

from train_recipes.model.build import unwrap

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    from train_recipes.data.processors import Processor

logger = logging.getLogger(__name__)

__all__ = ["export_hf"]


def _is_peft(model: nn.Module) -> TypeGuard[PeftModel]:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated state dict on CPU (collective for FSDP2; only rank 0 gets tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def export_hf(
    model: nn.Module,
    tokenizer: Processor,
    out_dir: str | Path,
    *,
    is_main: bool,
    lora_export: str = "merged",
) -> Path | None:
    """Write the model in Hugging Face format (config + safetensors + tokenizer) on rank 0.

    Collective under a process group: the weights are streamed shard by shard, each
    safetensors file written by one rank (``streaming_export``), never gathered whole. A
    peft LoRA model is written either
    merged into a plain model ("merged", from a copy: the live model keeps its adapters) or as
    the adapter alone ("adapter": adapter_config.json + adapter_model.safetensors, loadable with
    ``peft.PeftModel.from_pretrained(base, dir)``). Returns the directory on rank 0.
    """
    inner_model = unwrap(model)
    if _is_peft(inner_model):
        from train_recipes.export.lora import export_lora

        return export_lora(
            inner_model, tokenizer, out_dir, is_main=is_main, lora_export=lora_export
        )
    from train_recipes.model.moe import is_convertible, to_hf_layout

    if is_convertible(inner_model):
        # Converted MoE: the experts go back to the HF layout, gathered over ep (collective).
        state = to_hf_layout(model, _full_state_dict(model))
        if not is_main:
            return None
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        hf_model = cast("PreTrainedModel", inner_model)  # a transformers MoE model, converted
        hf_model.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)
        logger.info("exported the MoE model to %s", out)
        return out
    from train_recipes.export.streaming import export_streaming

    out = export_streaming(unwrap(model), out_dir)
    if not is_main:
        return None
    tokenizer.save_pretrained(out)
    logger.info("exported the model to %s", out)
    return out
