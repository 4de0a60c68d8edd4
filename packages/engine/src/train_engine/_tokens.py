"""Token counts of contract (b): summed, validated and turned into the backward's scale.

All of it without a host-device sync: the sum runs over the data-parallel ranks on device.

A count that lives on the host (a Python number, a CPU tensor) is checked at once. A count on
an accelerator cannot be read without stalling the host (the Engine promises no host
synchronisation per step), so its value is validated on the device instead: an invalid count
makes the micro-batch's gradient NaN and the Engine's non-finite policy acts on the window.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "backend_device",
    "device_token_scale",
    "host_num_tokens",
    "sum_over_groups",
    "token_scaled",
]


def backend_device(group: dist.ProcessGroup | None) -> torch.device:
    """A device whose tensors the group's backend can reduce (CUDA for NCCL, else CPU)."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend) and "gloo" not in str(backend):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_groups(
    local_count: int | float | Tensor, groups: tuple[dist.ProcessGroup, ...]
) -> Tensor:
    """Sum a per-rank count over each group in turn (see :meth:`Engine.global_num_tokens`)."""
    if isinstance(local_count, Tensor):
        if local_count.numel() != 1:
            raise ValueError(
                f"local_count must hold one value, got shape {tuple(local_count.shape)}"
            )
        count = local_count.detach().reshape(()).clone()
    else:
        dtype = torch.int64 if isinstance(local_count, int) else torch.float64
        count = torch.tensor(local_count, dtype=dtype)
    if count.dtype.is_floating_point:
        count = count.to(torch.float64)
    else:
        count = count.to(torch.int64)
    for group in groups:
        count = count.to(backend_device(group))
        if dist.get_world_size(group) > 1:
            dist.all_reduce(count, group=group)
    return count


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


def token_scaled(
    loss: Tensor,
    num_tokens: int | float | Tensor,
    host_tokens: float | None,
    *,
    reference: float | Tensor | None,
    size: int | float,
) -> Tensor:
    """``loss * size / num_tokens`` (0 for an empty window), checked against the window.

    Args:
        loss: the micro-batch's 0-dim loss sum.
        num_tokens: the window's global count as passed to backward().
        host_tokens: its checked host value (:func:`host_num_tokens`), None on a device.
        reference: the window's first count (host value or device tensor), None at first.
        size: the wrapper's gradient-averaging factor.
    """
    if host_tokens is None or isinstance(reference, Tensor):
        # The count (or the window's first count) is on an accelerator: validated on the
        # device (NaN gradient when invalid), since reading it would stall the host.
        count = num_tokens if isinstance(num_tokens, Tensor) else torch.tensor(host_tokens)
        scale = device_token_scale(count, size, reference=reference, device=loss.device)
        return loss * scale.to(loss.dtype)
    # Checked on the host: G / n, or 0 (a window without tokens contributes a
    # graph-connected zero).
    return loss * (size / host_tokens if host_tokens > 0 else 0.0)
