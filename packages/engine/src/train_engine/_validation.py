"""Checks of the Engine's inputs that catch silent misuse, without a host-device sync.

The Engine promises no host synchronisation per step with fused optimizers (tested under
CUDA's sync debug mode), so these read only host state: tensor metadata, autograd graph
handles and parameter identities. Token counts are checked in :mod:`train_engine._tokens`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from train_engine._update import POLICIES

__all__ = ["check_engine_arguments", "check_loss", "check_optimizer_params"]


def check_engine_arguments(
    model: object, optimizer: object, max_grad_norm: float | None, nonfinite: str
) -> None:
    """Raise on an Engine argument of the wrong kind or value, naming the fix."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(
            f"max_grad_norm must be > 0, got {max_grad_norm}; pass None to disable clipping"
        )
    if nonfinite not in POLICIES:
        raise ValueError(f"nonfinite must be one of {POLICIES}, got {nonfinite!r}")


def check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise when the optimizer updates tensors that are not the model's parameters.

    The usual cause is an optimizer built before ``fully_shard``/DDP replaced the parameters,
    or over another copy of the model: the Engine would compute gradients for the model and
    the optimizer would step tensors that never receive them (training silently does nothing).
    """
    owned = {id(p) for p in model.parameters()}
    foreign = [
        (g, i, p)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in owned
    ]
    if foreign:
        g, i, p = foreign[0]
        total = sum(len(group["params"]) for group in optimizer.param_groups)
        raise ValueError(
            f"the optimizer holds {len(foreign)} of {total} tensors that are not parameters of "
            f"the model (first: param_groups[{g}]['params'][{i}], shape {tuple(p.shape)}); "
            "build the optimizer from the model passed to the Engine, after wrapping it "
            "(apply_data_parallel, fully_shard and DDP replace or register the parameters)"
        )


def check_loss(loss: object) -> None:
    """Raise unless ``loss`` is a 0-dim tensor with an autograd graph (host-only checks)."""
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
    if loss.ndim != 0:
        raise ValueError(
            f"loss must be a scalar (0-dim) tensor, got shape {tuple(loss.shape)}; reduce it "
            "first (mean for contract (a), sum with num_tokens= for contract (b))"
        )
    if not loss.requires_grad:
        raise ValueError(
            "loss does not require grad (computed under torch.no_grad(), or detached); "
            "compute it from the model's output with gradients enabled"
        )
    if loss.grad_fn is None:
        raise ValueError(
            "loss is a leaf tensor (requires_grad=True but no grad_fn): it was not computed "
            "from the model's output, so its backward reaches no parameter; compute the "
            "loss from engine(...)'s output"
        )
