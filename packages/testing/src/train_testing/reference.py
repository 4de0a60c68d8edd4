"""Float64 references for the packages' tests: plain PyTorch, computed another way.

A test checks a package's result against what plain PyTorch computes in float64 from the same
inputs. Nothing here calls code under test (vocab-parallel's losses, the sharder, the Engine):
a label's log-probability is ``log_softmax`` + ``gather`` over the whole vocabulary in float64,
gradients are autograd's, and the errors are measured in float64.

# N tokens (any leading dims [...]), V vocabulary
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "IGNORE_INDEX",
    "grads_of",
    "max_relative_error",
    "relative_error",
    "token_log_probs",
    "token_sum_cross_entropy",
    "worst_grad_error",
]

# The label value of an untrained position (transformers' and PyTorch's default).
IGNORE_INDEX = -100


def token_log_probs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Each label's log softmax(logits / temperature) in float64; 0 at ignored positions.

    Args:
        logits: [..., V], any float dtype (computed in float64; differentiable).
        labels: [...] int64, already shifted (``labels[t]`` is the target of position t).
        temperature: divides the logits.
        ignore_index: the label of untrained positions.

    Returns:
        [...] float64.
    """
    log_p = F.log_softmax(logits.double() / temperature, dim=-1)
    valid = labels != ignore_index
    picked = log_p.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    # A masked (-inf) column read at an ignored row must give 0, not -inf * 0 = nan.
    return torch.where(valid, picked, torch.zeros_like(picked))


def token_sum_cross_entropy(
    logits: Tensor, labels: Tensor, *, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """The token-sum cross-entropy: -sum of log p(label) over the trained positions.

    Args:
        logits: [..., V], any float dtype (computed in float64; differentiable).
        labels: [...] int64, already shifted; ``ignore_index`` positions add nothing.
        ignore_index: the label of untrained positions.

    Returns:
        0-dim float64.
    """
    return -token_log_probs(logits, labels, ignore_index=ignore_index).sum()


def grads_of(
    model: nn.Module, *, missing: Literal["skip", "zeros", "raise"] = "skip"
) -> dict[str, Tensor]:
    """Every parameter's gradient as a float64 copy, by parameter name.

    A DTensor gradient is gathered whole (``full_tensor``: a collective, every rank calls it).

    Args:
        model: the module whose ``.grad`` fields to read.
        missing: a parameter without a gradient is left out ("skip"), given zeros ("zeros"),
            or an error ("raise").

    Raises:
        AssertionError: ``missing="raise"`` and a parameter has no gradient.
    """
    out: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            if missing == "raise":
                raise AssertionError(f"{name} got no gradient")
            if missing == "zeros":
                out[name] = torch.zeros(param.shape, dtype=torch.float64, device=param.device)
            continue
        full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        out[name] = full.detach().to(torch.float64, copy=True)
    return out


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """||actual - expected|| / ||expected|| (Frobenius norms, in float64, on CPU).

    An all-zero ``expected`` gives the absolute error instead of a division by zero.
    """
    want = expected.detach().double().cpu()
    diff = actual.detach().double().cpu() - want
    return float(diff.norm() / want.norm().clamp(min=1e-30))


def max_relative_error(actual: Tensor, expected: Tensor, *, floor: float = 1e-12) -> float:
    """The largest error against the tensor's scale: max |a - e| / (max |e| + floor), float64.

    Args:
        actual: any shape and float dtype.
        expected: the same shape.
        floor: added to the scale, so a zero ``expected`` compares absolutely.
    """
    want = expected.detach().double().cpu()
    diff = actual.detach().double().cpu() - want
    return float(diff.abs().max()) / (float(want.abs().max()) + floor) if want.numel() else 0.0


def worst_grad_error(
    grads: Mapping[str, Tensor], expected: Mapping[str, Tensor], *, floor: float = 1e-12
) -> tuple[float, str]:
    """The largest :func:`max_relative_error` over ``expected``'s parameters, and its name.

    A name ``grads`` lacks compares as zeros (its whole gradient counts as error).

    Returns:
        (error, parameter name), or (0.0, "") when every gradient matches exactly.
    """
    worst, worst_name = 0.0, ""
    for name, want in expected.items():
        got = grads.get(name)
        err = max_relative_error(torch.zeros_like(want) if got is None else got, want, floor=floor)
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name
