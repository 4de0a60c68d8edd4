"""Decay / no-decay optimizer parameter groups."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["param_groups"]

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)


def _default_no_decay(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    # Biases and norm scales: decaying them pulls activations' offsets and scales toward 0,
    # which hurts; any other 0-/1-D parameter (e.g. a custom RMSNorm weight) is treated alike.
    leaf = name.rsplit(".", 1)[-1]
    return (
        leaf == "bias"
        or isinstance(module, _NORM_TYPES)
        or "norm" in type(module).__name__.lower()
        or param.ndim < 2
    )


def param_groups(
    model: nn.Module,
    *,
    weight_decay: float,
    no_decay: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[dict[str, Any]]:
    """Split trainable parameters into a decayed and a non-decayed optimizer group.

    Call it on the model the optimizer will update (after ``fully_shard`` under FSDP2, so the
    groups hold the sharded parameters). Frozen parameters are left out; a parameter shared by
    several modules (tied embeddings) appears once. Empty groups are dropped, so the result can
    be passed straight to any ``torch.optim`` constructor.

    Args:
        model: the module.
        weight_decay: decay of the first group (>= 0).
        no_decay: ``(qualified_name, param) -> True`` for parameters without decay; None uses
            biases, parameters of normalisation modules and any parameter with fewer than 2 dims.

    Returns:
        ``[{"params": [...], "weight_decay": weight_decay, "param_names": [...]},
        {"params": [...], "weight_decay": 0.0, "param_names": [...]}]`` minus empty groups.
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    seen: set[int] = set()
    decay: list[tuple[str, nn.Parameter]] = []
    keep: list[tuple[str, nn.Parameter]] = []
    for module_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{leaf}" if module_name else leaf
            skip = (
                no_decay(name, param)
                if no_decay is not None
                else _default_no_decay(module, name, param)
            )
            (keep if skip else decay).append((name, param))
    groups = []
    for members, wd in ((decay, weight_decay), (keep, 0.0)):
        if members:
            groups.append(
                {
                    "params": [p for _, p in members],
                    "weight_decay": wd,
                    "param_names": [n for n, _ in members],
                }
            )
    if not groups:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    return groups
