"""What every recipe's ``setup()`` shares: the run folder, the optimizer and its LR schedule.

The process group and device mesh come from :func:`train_recipes._dist.init_distributed`, the
schedule from :func:`train_recipes.schedule.build_lr_scheduler` (``transformers.get_scheduler``
for cosine and constant), the loop from :mod:`train_recipes.loop`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from torch import nn

from train_recipes.config_loader import to_dict
from train_recipes.run_folder import CONFIG_FILE, write_atomic
from train_recipes.schedule import build_lr_scheduler

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from train_recipes.config_shared import OptimConfig

__all__ = ["build_optimizer", "open_run_folder", "write_run_config"]


def open_run_folder(output_dir: str | Path, *, is_main: bool) -> Path:
    """The run directory, created by the main rank (the others write only below it, later)."""
    out_dir = Path(output_dir)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def write_run_config(out_dir: Path, config: Any, *, is_main: bool) -> None:
    """``config.yaml``: the config that trains from here on (written whole, main rank)."""
    if is_main:
        write_atomic(out_dir / CONFIG_FILE, yaml.safe_dump(to_dict(config), sort_keys=False))


def build_optimizer(
    model: nn.Module, optim: OptimConfig, *, device: torch.device, total_steps: int
) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """AdamW over train-engine's parameter groups, with ``optim.schedule`` over the run.

    Args:
        model: the wrapped model (DDP or FSDP2).
        optim: lr, betas, eps, weight decay (matrices only), fused (None: on CUDA), schedule.
        device: the rank's device (decides ``fused`` when it is None).
        total_steps: optimizer updates of the whole run.

    Returns:
        The optimizer and its LR scheduler.
    """
    from train_engine import param_groups

    optimizer = torch.optim.AdamW(
        param_groups(model, weight_decay=optim.weight_decay),
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        fused=device.type == "cuda" if optim.fused is None else optim.fused,
    )
    return optimizer, build_lr_scheduler(optimizer, optim, total_steps=total_steps)
