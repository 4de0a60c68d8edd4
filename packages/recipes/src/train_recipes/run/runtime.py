"""What every recipe's ``setup()`` shares: the run folder, the optimizer and its LR schedule.

The optimizer is AdamW: train-engine's :class:`~train_engine.MasterWeightAdamW` (fp32 master
weights in the optimizer) when the model trains bf16/fp16 parameters, else ``torch.optim.AdamW``
(see ``optim.master_weights``). AdamW directly on bf16 weights loses every update below half a
unit in the last place (``2**-9`` of the weight): at a fine-tuning rate of 2e-5, most of them.

The process group and device mesh come from :func:`train_recipes.run.process_group.init_distributed`, the
schedule from :func:`train_recipes.run.schedule.build_lr_scheduler` (``transformers.get_scheduler``
for cosine and constant), the loop from :mod:`train_recipes.loop.drive`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from torch import nn

from train_recipes.config.loader import to_dict
from train_recipes.run.folder import CONFIG_FILE, write_atomic
from train_recipes.run.schedule import build_lr_scheduler

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from train_recipes.config.dpo import DPOConfig
    from train_recipes.config.grpo import GRPOConfig
    from train_recipes.config.retrieval import RetrievalConfig
    from train_recipes.config.sft import SFTConfig
    from train_recipes.config.shared import OptimConfig

__all__ = [
    "OptimizerChoice",
    "build_optimizer",
    "choose_optimizer",
    "open_run_folder",
    "write_run_config",
]

logger = logging.getLogger(__name__)

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def open_run_folder(output_dir: str | Path, *, is_main: bool) -> Path:
    """The run directory, created by the main rank (the others write only below it, later)."""
    out_dir = Path(output_dir)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def write_run_config(
    out_dir: Path,
    config: SFTConfig | RetrievalConfig | GRPOConfig | DPOConfig,
    *,
    is_main: bool,
) -> None:
    """``config.yaml``: the config that trains from here on (written whole, main rank)."""
    if is_main:
        write_atomic(out_dir / CONFIG_FILE, yaml.safe_dump(to_dict(config), sort_keys=False))


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerChoice:
    """Which AdamW :func:`build_optimizer` builds, and the start-up line that says why.

    Attributes:
        master_weights: MasterWeightAdamW (fp32 master weights) rather than torch's AdamW.
        line: one line naming the optimizer and the reason.
    """

    master_weights: bool
    line: str


def choose_optimizer(
    model: nn.Module, optim: OptimConfig, *, device: torch.device
) -> OptimizerChoice:
    """Resolve ``optim.master_weights`` from the trainable parameters of the wrapped model.

    The parameters are read as the optimizer will see them (FSDP2's DTensor shards, a DDP
    wrapper's module, LoRA's adapters without the frozen base), so None means: master weights
    exactly when some parameter the optimizer updates is bf16/fp16.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    low = sorted(
        {str(p.dtype).removeprefix("torch.") for p in trainable if p.dtype in _LOW_PRECISION}
    )
    count = sum(p.dtype in _LOW_PRECISION for p in trainable)
    dtypes = "/".join(low)
    setting = optim.master_weights
    if setting is None:
        master = count > 0
        why = (
            f"{count} of {len(trainable)} trainable parameter tensors are {dtypes}"
            if master
            else f"the {len(trainable)} trainable parameter tensors are float32"
        ) + " (optim.master_weights=null)"
    else:
        master = setting
        why = f"optim.master_weights={str(setting).lower()}"
        if not master and count:
            why += (
                f"; AdamW directly on {count} {dtypes} parameter tensors: updates below half "
                "a unit in their last place round away"
            )
    if master:
        backend = "Triton" if device.type == "cuda" else "torch ops"
        line = f"optimizer: MasterWeightAdamW, fp32 master weights ({backend}): {why}"
    else:
        fused = device.type == "cuda" if optim.fused is None else optim.fused
        line = f"optimizer: torch.optim.AdamW (fused={fused}): {why}"
    return OptimizerChoice(master_weights=master, line=line)


def build_optimizer(
    model: nn.Module,
    optim: OptimConfig,
    *,
    device: torch.device,
    total_steps: int,
    choice: OptimizerChoice | None = None,
) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """AdamW over train-engine's parameter groups, with ``optim.schedule`` over the run.

    The AdamW is :class:`~train_engine.MasterWeightAdamW` or ``torch.optim.AdamW`` as
    :func:`choose_optimizer` resolves ``optim.master_weights``; its line is logged (INFO). Both
    get the same groups (weight decay on matrices only) and hyperparameters.

    Args:
        model: the wrapped model (DDP or FSDP2), or the model itself (``data_parallel: none``).
        optim: lr, betas, eps, weight decay (matrices only), fused (None: on CUDA; torch's
            AdamW only), master_weights, schedule.
        device: the rank's device (decides ``fused`` when it is None, and the master-weight
            kernel: Triton on CUDA, torch ops elsewhere).
        total_steps: optimizer updates of the whole run.
        choice: :func:`choose_optimizer`'s result for these arguments, when the caller
            already has it (to print its line); None resolves it here.

    Returns:
        The optimizer and its LR scheduler.
    """
    from train_engine import MasterWeightAdamW, param_groups

    if choice is None:
        choice = choose_optimizer(model, optim, device=device)
    logger.info("%s", choice.line)
    groups = param_groups(model, weight_decay=optim.weight_decay)
    optimizer: torch.optim.Optimizer
    if choice.master_weights:
        optimizer = MasterWeightAdamW(
            groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, backend="auto"
        )
    else:
        optimizer = torch.optim.AdamW(
            groups,
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            fused=device.type == "cuda" if optim.fused is None else optim.fused,
        )
    return optimizer, build_lr_scheduler(optimizer, optim, total_steps=total_steps)
