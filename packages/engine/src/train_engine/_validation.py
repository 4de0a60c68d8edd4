"""Checks of the Engine's inputs that catch silent misuse, without a host-device sync.

The Engine promises no host synchronisation per step with fused optimizers (tested under
CUDA's sync debug mode). Every check here therefore reads only host state: Python numbers,
tensor metadata (dtype, shape, device), CPU tensors (reading one waits for no device), and
parameter identities. A token count that lives on the GPU cannot be read without a sync, so
its value is validated on the device instead (see :func:`device_token_scale`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["check_optimizer_params", "device_token_scale", "host_num_tokens"]


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


def host_num_tokens(num_tokens: object) -> float | None:
    """Validate a ``num_tokens`` argument; its value when readable without a device sync.

    Returns:
        The count as a float for a Python number or a CPU tensor (checked: finite, >= 0);
        None for a tensor on an accelerator, whose value is checked on the device instead.

    Raises:
        TypeError: a bool, a bool tensor, or something that is not a number or tensor.
        ValueError: a tensor of more than one value, or a value that is nan, inf or < 0.
    """
    fix = "pass engine.global_num_tokens(local_count), the whole window's global count"
    if isinstance(num_tokens, bool) or (
        isinstance(num_tokens, Tensor) and num_tokens.dtype == torch.bool
    ):
        raise TypeError(
            f"num_tokens must be a count of loss tokens, got a bool ({num_tokens}); {fix}"
        )
    if isinstance(num_tokens, Tensor):
        if num_tokens.numel() != 1:
            raise ValueError(
                f"num_tokens must hold one value, got shape {tuple(num_tokens.shape)}; {fix}"
            )
        if num_tokens.is_complex():
            raise TypeError(f"num_tokens must be real, got dtype {num_tokens.dtype}; {fix}")
        # A pinned CPU tensor may still be the target of a non-blocking copy from the GPU:
        # only the device stream knows when it holds the value.
        pinned = torch.cuda.is_initialized() and num_tokens.is_pinned()
        if num_tokens.device.type != "cpu" or pinned:
            return None
        value = float(num_tokens.detach().reshape(()))
    elif isinstance(num_tokens, int | float):
        value = float(num_tokens)
    else:
        raise TypeError(
            f"num_tokens must be an int, float or 0-dim tensor, got {type(num_tokens).__name__}; "
            f"{fix}"
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"num_tokens must be finite and >= 0, got {value}; {fix}")
    return value


def device_token_scale(
    num_tokens: Tensor, size: float, *, reference: Tensor | float | None, device: torch.device
) -> Tensor:
    """``size / num_tokens`` on the device, NaN when the count is invalid (no host read).

    A count that is nan, inf or negative, or differs from the window's first count
    (``reference``), turns the micro-batch's gradient into NaN. The window's global gradient
    norm is then NaN on every rank, so the Engine's non-finite policy acts on it: the update
    is skipped (``"skip"``, reported in :class:`StepResult` and logged) or
    :class:`NonFiniteGradientError` is raised (``"raise"``). A zero count gives 0 (a window
    without loss tokens contributes a graph-connected zero).

    Args:
        num_tokens: 0-dim count on an accelerator.
        size: the wrapper's gradient-averaging factor.
        reference: the window's first count (a tensor or a checked host value), None for the
            window's first backward.
        device: the loss's device.

    Returns:
        0-dim float64 tensor on ``device``.
    """
    n = num_tokens.detach().to(device=device, dtype=torch.float64).reshape(())
    valid = torch.isfinite(n) & (n >= 0)
    if reference is not None and reference is not num_tokens:
        if isinstance(reference, Tensor):
            reference = reference.detach().to(device=device, dtype=torch.float64).reshape(())
        valid = valid & (n == reference)
    # size / inf = 0 for an empty window.
    scale = size / torch.where(n > 0, n, torch.full_like(n, math.inf))
    return torch.where(valid, scale, torch.full_like(scale, math.nan))
