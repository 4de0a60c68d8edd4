"""DeepSpeed-style training Engine around an already-distributed PyTorch model: exact accumulation, sharding-aware clipping, DDP/FSDP2 setup, resumable checkpoints."""

from importlib.metadata import version as _version

from train_engine.checkpoint import (
    CheckpointCorruptError,
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
from train_engine.setup import DDPConfig, FSDP2Config, apply_data_parallel

__version__ = _version("train-engine")

__all__ = [
    "CheckpointCorruptError",
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
    "global_grad_norm",
    "latest_checkpoint",
    "load_checkpoint",
    "param_groups",
    "save_checkpoint",
]
