"""DeepSpeed-style training Engine around an already-distributed PyTorch model: exact accumulation, sharding-aware clipping, DDP/FSDP2 setup, resumable checkpoints."""

from __future__ import annotations

import importlib
import sys
import types
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

# Torch-free as well: where a checkpoint would go, the space left (a pre-launch check reads it).
from train_engine._save_errors import free_disk_bytes

# The wrappers' settings import no torch: a config that holds them is read without it.
from train_engine.dp_config import DDPConfig, FSDP2Config

if TYPE_CHECKING:
    from train_engine.checkpoint import (
        CheckpointCorruptError,
        CheckpointWriteError,
        LoadedCheckpoint,
        complete_checkpoints,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from train_engine.engine import Engine, NonFiniteGradientError, StepResult
    from train_engine.expert_parallel import ExpertShards
    from train_engine.grad_norm import clip_grads_with_norm_, global_grad_norm
    from train_engine.loss_window import LossWindow
    from train_engine.master_adamw import MasterWeightAdamW
    from train_engine.param_groups import param_groups
    from train_engine.setup import apply_data_parallel

__version__ = _version("train-engine")

# The names that need torch, imported on first use (PEP 562), so `import train_engine` (and
# `from train_engine import DDPConfig`) costs no torch import.
_LAZY = {
    "CheckpointCorruptError": "checkpoint",
    "CheckpointWriteError": "checkpoint",
    "LoadedCheckpoint": "checkpoint",
    "complete_checkpoints": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "Engine": "engine",
    "NonFiniteGradientError": "engine",
    "StepResult": "engine",
    "ExpertShards": "expert_parallel",
    "clip_grads_with_norm_": "grad_norm",
    "global_grad_norm": "grad_norm",
    "LossWindow": "loss_window",
    "MasterWeightAdamW": "master_adamw",
    "param_groups": "param_groups",
    "apply_data_parallel": "setup",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'train_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"train_engine.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """The package module: an imported submodule never hides the function of its name.

    The import system binds each submodule to its name on the package; ``param_groups`` is
    both a submodule and the function the API exports, and the function must win.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "CheckpointCorruptError",
    "CheckpointWriteError",
    "DDPConfig",
    "Engine",
    "ExpertShards",
    "FSDP2Config",
    "LoadedCheckpoint",
    "LossWindow",
    "MasterWeightAdamW",
    "NonFiniteGradientError",
    "StepResult",
    "__version__",
    "apply_data_parallel",
    "clip_grads_with_norm_",
    "complete_checkpoints",
    "free_disk_bytes",
    "global_grad_norm",
    "latest_checkpoint",
    "load_checkpoint",
    "param_groups",
    "save_checkpoint",
]
