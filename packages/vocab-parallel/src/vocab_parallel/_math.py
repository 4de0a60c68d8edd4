"""Per-chunk softmax statistics and gradients: pure tensor math, no process groups.

# T tokens (rows of one chunk), V columns of the local vocabulary shard

Every function works on one chunk of fp32 logits that the caller owns (a fresh copy), so the
in-place arithmetic below never touches the user's tensor and a chunk costs one or two fp32
buffers of [T, V], however large the whole logits tensor is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vocab_parallel._stats import LOG_FLOOR, GradTerms, ShardStats


def scale_by_upstream_(grad: Tensor, grad_loss: Tensor, *, backend: str) -> None:
    """Multiply a gradient formed in forward by the scalar upstream gradient, in place.

    In the gradient's dtype: exact when the upstream gradient is 1. On the Triton backend a
    contiguous gradient takes one vectorized kernel, which touches nothing for a scale of
    exactly 1 (same values as ``mul_``, whose bf16-by-fp32-scalar kernel is unvectorized).

    Args:
        grad: the stored gradient (modified).
        grad_loss: 0-dim upstream gradient of the loss.
        backend: "triton" or "torch", the backend that formed ``grad``.
    """
    if backend == "triton" and grad.is_contiguous():
        from vocab_parallel import _triton_scale

        _triton_scale.scale_(grad, grad_loss.to(torch.float32).reshape(1).contiguous())
    else:  # e.g. a strided slice of larger logits (logits[:, :-1])
        grad.mul_(grad_loss)


def scaled_fp32(chunk: Tensor, inv_temperature: float) -> Tensor:
    """A fresh fp32 copy of ``chunk * inv_temperature`` that may be modified in place.

    Args:
        chunk: [T, V] logits of any float dtype.
        inv_temperature: 1 / temperature.

    Returns:
        [T, V] float32, never aliasing ``chunk``.
    """
    z = chunk.to(torch.float32, copy=True)
    if inv_temperature != 1.0:
        z.mul_(inv_temperature)
    return z


def scaled_target(values: Tensor, inv_temperature: float) -> Tensor:
    """The same scaling as :func:`scaled_fp32` for gathered target logits [T] (bitwise equal)."""
    z = values.to(torch.float32, copy=True)
    if inv_temperature != 1.0:
        z.mul_(inv_temperature)
    return z


def safe_shift(max_: Tensor) -> Tensor:
    """The max, with -inf (a fully masked row) replaced by 0 so that z - shift stays -inf, not nan."""
    return torch.where(max_ == float("-inf"), torch.zeros_like(max_), max_)


def shard_stats(z: Tensor, *, entropy: bool, sum_z: bool) -> ShardStats:
    """Softmax statistics of one chunk; consumes ``z`` (modified in place).

    Args:
        z: [T, V] float32 scaled logits owned by the caller.
        entropy: also return sum exp(z - shift) * (z - shift).
        sum_z: also return the plain sum of z.

    Returns:
        :class:`ShardStats` with [T] tensors.
    """
    rows, cols = z.shape
    if cols == 0:
        zeros = z.new_zeros(rows)
        return ShardStats(
            max=z.new_full((rows,), float("-inf")),
            sum_exp=zeros,
            sum_exp_z=zeros.clone() if entropy else None,
            sum_z=zeros.clone() if sum_z else None,
        )
    total = z.sum(-1) if sum_z else None
    max_ = z.amax(-1)
    u = z.sub_(safe_shift(max_).unsqueeze(-1))
    e = torch.exp(u)
    sum_exp = e.sum(-1)
    sum_exp_z = None
    if entropy:
        u.clamp_(min=LOG_FLOOR)
        sum_exp_z = e.mul_(u).sum(-1)
    return ShardStats(max=max_, sum_exp=sum_exp, sum_exp_z=sum_exp_z, sum_z=total)


def rescale(stats: ShardStats, new_max: Tensor) -> ShardStats:
    """Re-express a shard's statistics relative to a larger (global or running) max.

    After rescaling, ``sum_exp`` is sum exp(z - safe_shift(new_max)) and ``sum_exp_z`` is
    sum exp(z - s) * (z - s) with the same s, so rescaled shards simply add up.

    Args:
        stats: statistics from :func:`shard_stats` (relative to the shard's own max).
        new_max: [T] max over all shards being combined (>= stats.max).
    """
    target = safe_shift(new_max)
    # exp(-inf - target) = 0: a fully masked shard contributes nothing, even when target is 0.
    scale = torch.exp(stats.max - target)
    sum_exp = stats.sum_exp * scale
    sum_exp_z = None
    if stats.sum_exp_z is not None:
        offset = safe_shift(stats.max) - target
        sum_exp_z = (stats.sum_exp_z + offset * stats.sum_exp) * scale
    return ShardStats(max=new_max, sum_exp=sum_exp, sum_exp_z=sum_exp_z, sum_z=stats.sum_z)


def merge(a: ShardStats, b: ShardStats) -> ShardStats:
    """Combine the statistics of two disjoint vocabulary blocks (online softmax)."""
    new_max = torch.maximum(a.max, b.max)
    ra, rb = rescale(a, new_max), rescale(b, new_max)

    def _add(x: Tensor | None, y: Tensor | None) -> Tensor | None:
        return None if x is None or y is None else x + y

    return ShardStats(
        max=new_max,
        sum_exp=ra.sum_exp + rb.sum_exp,
        sum_exp_z=_add(ra.sum_exp_z, rb.sum_exp_z),
        sum_z=_add(ra.sum_z, rb.sum_z),
    )


def chunk_grad(z: Tensor, terms: GradTerms, *, inv_vocab: float) -> Tensor:
    """Gradient w.r.t. the scaled logits z of one chunk; consumes ``z`` (modified in place).

    With p = softmax(z) over the full vocabulary and log p = z - logZ:
    d log p_y / dz = onehot_y - p;  d H / dz = -p (log p + H);  d mean_v log p_v / dz = 1/V - p.

    Args:
        z: [T, V] float32 scaled logits owned by the caller.
        terms: the chunk's [T] upstream gradients and global statistics.
        inv_vocab: 1 / (global V).

    Returns:
        [T, V] float32 gradient (the ``z`` buffer).
    """
    coef: Tensor | None = None
    for g in (terms.grad_all, terms.grad_uniform):
        if g is not None:
            coef = g if coef is None else coef + g
    log_p = z.sub_(terms.log_normalizer.unsqueeze(-1))
    if terms.grad_entropy is not None:
        if terms.entropy is None:
            raise ValueError("chunk_grad needs the entropy to differentiate it")
        log_p.clamp_(min=LOG_FLOOR)
        p = torch.exp(log_p)
        w = log_p.add_(terms.entropy.unsqueeze(-1)).mul_(terms.grad_entropy.unsqueeze(-1))
        if coef is not None:
            w.add_(coef.unsqueeze(-1))
        grad = w.mul_(p).neg_()
    elif coef is not None:
        grad = log_p.exp_().mul_(coef.neg().unsqueeze(-1))
    else:
        grad = log_p.zero_()
    if terms.grad_uniform is not None:
        grad.add_((terms.grad_uniform * inv_vocab).unsqueeze(-1))
    if terms.target_index is not None and terms.target_grad is not None:
        grad.scatter_add_(1, terms.target_index.unsqueeze(-1), terms.target_grad.unsqueeze(-1))
    return grad
