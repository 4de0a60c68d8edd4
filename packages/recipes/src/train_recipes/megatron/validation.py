"""Config checks for ``model.backend: megatron`` (run before any process starts)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from train_recipes.config.extras import install_hint
from train_recipes.config.loader import ConfigError

if TYPE_CHECKING:
    from train_recipes.config.sft import SFTConfig

__all__ = ["check_megatron_config"]


def check_megatron_config(config: SFTConfig) -> None:
    """Reject what the megatron backend does not do, naming the key and the way out.

    Raises:
        ConfigError: a missing megatron-core, or an option only the HF backend has.
    """
    # find_spec of a submodule imports its parent: ask for the parent first.
    if importlib.util.find_spec("megatron") is None or (
        importlib.util.find_spec("megatron.core") is None
    ):
        raise ConfigError(
            "model.backend",
            f"megatron needs megatron-core; {install_hint('megatron')} "
            "(megatron-core 0.16.1 on Python 3.11), or use model.backend=hf",
        )
    model, parallel = config.model, config.parallel
    # (key, is set, why not, the way out)
    unsupported = [
        (
            "parallel.cp",
            parallel.cp > 1,
            "Megatron models use Megatron's own context "
            "parallelism (Transformer Engine attention), which this backend does not set up",
            "set parallel.cp=1",
        ),
        (
            "parallel.data_parallel",
            parallel.data_parallel != "ddp",
            "the GPTModel is wrapped in "
            "PyTorch DDP (its tp shards are synced by the Engine); FSDP2 and 'none' (no "
            "wrapper) are not supported for it",
            "set parallel.data_parallel=ddp",
        ),
        ("lora.enabled", config.lora.enabled, "LoRA targets the HF modules", "disable LoRA"),
        (
            "model.compile",
            model.compile,
            "compiling Megatron's layers is not tested here",
            "set model.compile=false",
        ),
        (
            "model.activation_checkpointing",
            model.activation_checkpointing,
            "Megatron's recompute is not mapped",
            "set model.activation_checkpointing=false",
        ),
        (
            "model.sharded_load",
            bool(model.sharded_load),
            "weights are converted from the HF model on every rank",
            "set model.sharded_load=false",
        ),
        (
            "data.model_family",
            config.data.model_family != "text",
            "a GPTModel is text-only",
            "use model_family text, or model.backend=hf for vision-language models",
        ),
    ]
    for key, is_set, why, fix in unsupported:
        if is_set:
            raise ConfigError(key, f"not supported with model.backend=megatron: {why}; {fix}")
