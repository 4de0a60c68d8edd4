# mypy: disable-error-code="no-untyped-def"
"""Triton kernels for the logits path on CUDA, at the memory-bandwidth floor.

One read of the logits forward, one read and one write backward, and no fp32 [N, V] buffer.

# N tokens (one program per token row; N = B slabs * R rows), V local vocabulary columns,
# BLOCK columns per step. Input rows are addressed through (slab stride, row stride), so a
# strided slice such as logits[:, :-1] is read in place; gradients are written contiguous.

Imported lazily: ``triton`` ships with CUDA builds of PyTorch. The same kernels run on CPU under
``TRITON_INTERPRET=1`` (how the CPU test suite checks them).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from vocab_parallel._stats import LOG_FLOOR, GradTerms, ShardStats

_MAX_BLOCK = 4096


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _stats_kernel(
    x_ptr,
    stride_slab,
    stride_row,
    rows_per_slab,
    n_cols,
    inv_t,
    max_ptr,
    sum_exp_ptr,
    sum_exp_z_ptr,
    sum_z_ptr,
    WANT_ENTROPY: tl.constexpr,
    WANT_SUM_Z: tl.constexpr,
    LOG_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Online softmax over the row. Invariant, with c = (m if m > -inf else 0):
    #   s = sum exp(z - c),  t = sum exp(z - c) * (z - c)
    row = tl.program_id(0).to(tl.int64)
    slab = row // rows_per_slab
    x_row = x_ptr + slab * stride_slab + (row - slab * rows_per_slab) * stride_row
    offsets = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    t = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    sz = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        mask = cols < n_cols
        z = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        if WANT_SUM_Z:
            sz += tl.sum(tl.where(mask, z, 0.0), 0)
        m_new = tl.maximum(m, tl.max(z, 0))
        c_old = tl.where(m == float("-inf"), 0.0, m)
        c_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        # exp(-inf - c_new) = 0: an empty running sum never turns into 0 * inf.
        scale = tl.exp(m - c_new)
        u = z - c_new
        e = tl.exp(u)
        if WANT_ENTROPY:
            t = scale * (t + (c_old - c_new) * s) + tl.sum(e * tl.maximum(u, LOG_FLOOR), 0)
        s = s * scale + tl.sum(e, 0)
        m = m_new
    tl.store(max_ptr + row, m)
    tl.store(sum_exp_ptr + row, s)
    if WANT_ENTROPY:
        tl.store(sum_exp_z_ptr + row, t)
    if WANT_SUM_Z:
        tl.store(sum_z_ptr + row, sz)


@triton.jit
def _grad_kernel(
    x_ptr,
    stride_slab,
    stride_row,
    rows_per_slab,
    g_ptr,
    g_stride_slab,
    g_stride_row,
    n_cols,
    inv_t,
    inv_vocab,
    log_z_ptr,
    entropy_ptr,
    g_all_ptr,
    g_entropy_ptr,
    g_uniform_ptr,
    target_col_ptr,
    g_target_ptr,
    HAS_TARGET: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_UNIFORM: tl.constexpr,
    LOG_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grad = -p * (g_all + g_uniform + g_entropy * (log p + H)) + g_uniform / V + onehot * g_target
    row = tl.program_id(0).to(tl.int64)
    slab = row // rows_per_slab
    x_row = x_ptr + slab * stride_slab + (row - slab * rows_per_slab) * stride_row
    g_row = g_ptr + slab * g_stride_slab + (row - slab * rows_per_slab) * g_stride_row
    offsets = tl.arange(0, BLOCK)
    log_z = tl.load(log_z_ptr + row)
    coef = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    g_target = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    target_col = -1
    if HAS_TARGET:
        coef += tl.load(g_all_ptr + row)
        g_target = tl.load(g_target_ptr + row)
        target_col = tl.load(target_col_ptr + row)
    if HAS_UNIFORM:
        g_uniform = tl.load(g_uniform_ptr + row)
        coef += g_uniform
    if HAS_ENTROPY:
        entropy = tl.load(entropy_ptr + row)
        g_entropy = tl.load(g_entropy_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        mask = cols < n_cols
        z = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
        log_p = z - log_z
        p = tl.exp(log_p)
        w = coef
        if HAS_ENTROPY:
            w = w + g_entropy * (tl.maximum(log_p, LOG_FLOOR) + entropy)
        grad = -p * w
        if HAS_UNIFORM:
            grad += g_uniform * inv_vocab
        if HAS_TARGET:
            grad += tl.where(cols == target_col, g_target, 0.0)
        tl.store(g_row + cols, grad.to(g_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _loss_grad_kernel(
    x_ptr,
    stride_slab,
    stride_row,
    rows_per_slab,
    n_cols,
    inv_t,
    labels_ptr,
    ignore_index,
    coef_ptr,
    coef_stride,
    log_p_ptr,
    BLOCK: tl.constexpr,
):
    # One token row of whole-vocabulary logits, everything a grads-in-forward loss of
    # sum_t c_t * log p(label_t) needs in one launch, from the raw labels and coefficients (no
    # per-token tensors prepared on the host side): pass 1 the online softmax normalizer (as
    # _stats_kernel), then log p(label), pass 2 the gradient g * (onehot - p), g = c / T,
    # written over the logits (each stretch is read before it is written; the row was read just
    # before, so part of it is still in L2). A label equal to ignore_index has g = 0 and
    # log p = 0; one outside [0, V) (unvalidated) keeps g but has no onehot and log p = 0.
    # coef_stride is 0 for one coefficient shared by every row.
    row = tl.program_id(0).to(tl.int64)
    slab = row // rows_per_slab
    x_row = x_ptr + slab * stride_slab + (row - slab * rows_per_slab) * stride_row
    offsets = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        z = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        c_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - c_new) + tl.sum(tl.exp(z - c_new), 0)
        m = m_new
    log_z = tl.where(m == float("-inf"), 0.0, m) + tl.log(s)
    label = tl.load(labels_ptr + row)
    trained = label != ignore_index
    in_vocab = trained & (label >= 0) & (label < n_cols)
    target_col = tl.where(in_vocab, label, -1)
    z_target = tl.load(x_row + tl.maximum(target_col, 0)).to(tl.float32) * inv_t
    tl.store(log_p_ptr + row, tl.where(in_vocab, z_target - log_z, 0.0))
    g = tl.where(trained, tl.load(coef_ptr + row * coef_stride).to(tl.float32) * inv_t, 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        mask = cols < n_cols
        z = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
        grad = tl.where(cols == target_col, g, 0.0) - g * tl.exp(z - log_z)
        tl.store(x_row + cols, grad.to(x_ptr.dtype.element_ty), mask=mask)


def loss_grad_(
    logits: Tensor,
    *,
    inv_temperature: float,
    labels: Tensor,
    ignore_index: int,
    coefficients: Tensor,
) -> Tensor:
    """Overwrite whole-vocabulary logits with the gradient of sum_t c_t * log p(label_t).

    Args:
        logits: [C, V] or [B, R, V] (C = B * R tokens) with unit stride along V, every column
            of the vocabulary (no shard); overwritten through its own strides by
            ``c_t / T * (onehot(label_t) - softmax(logits_t / T))``.
        inv_temperature: 1 / T.
        labels: [C] integer labels; ``ignore_index`` rows get no gradient and log p = 0.
        ignore_index: the label value without a target.
        coefficients: [C] or one (0-dim) float c_t, on the logits' device.

    Returns:
        log p(label) [C] fp32 (0 for an ignored or out-of-range label).
    """
    x = logits if logits.ndim == 3 else logits.unsqueeze(0)
    if x.stride(-1) != 1:
        raise ValueError("loss_grad_ writes through the logits' strides: the last must be 1")
    slabs, rows, v = x.shape
    if coefficients.numel() not in (1, slabs * rows):
        raise ValueError(
            f"coefficients has {coefficients.numel()} elements; expected 1 or one per token "
            f"({slabs * rows})"
        )
    log_p = torch.zeros(slabs * rows, device=logits.device, dtype=torch.float32)
    if slabs * rows == 0 or v == 0:
        return log_p
    coef = coefficients.reshape(-1)
    block, warps = _launch_config(v)
    with on_device(logits):
        _loss_grad_kernel[(slabs * rows,)](
            x,
            x.stride(0),
            x.stride(1),
            rows,
            v,
            inv_temperature,
            labels.contiguous(),
            ignore_index,
            coef,
            coef.stride(0) if coef.numel() > 1 else 0,
            log_p,
            BLOCK=block,
            num_warps=warps,
        )
    return log_p


def _launch_config(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the row kernels: 4096-column blocks, 4 warps, one row a program.

    On an H200 over [16384, 151936] bf16 logits, (4096, 4) was the fastest of seven configs
    for each kernel: the loss-and-gradient kernel ran its three passes at 4.05-4.11 TB/s
    against 3.99-4.00 for (8192, 8) and 3.73 for (32768, 32), and the statistics + gradient
    pair 3.90 against 3.82 TB/s (benchmarks/results/loss_grad_configs_h200_T*.json).
    """
    return min(_MAX_BLOCK, triton.next_power_of_2(max(n_cols, 16))), 4


def _slabs(logits: Tensor) -> Tensor:
    """[B, R, V] with unit stride along V (a 2-D input becomes one slab)."""
    x = logits if logits.ndim == 3 else logits.unsqueeze(0)
    return x if x.stride(-1) == 1 else x.contiguous()


def on_device(t: Tensor) -> contextlib.AbstractContextManager[None]:
    """Launch on the tensor's GPU, whatever the current device is."""
    if t.is_cuda:
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def shard_stats(
    logits: Tensor, *, inv_temperature: float, entropy: bool, sum_z: bool
) -> ShardStats:
    """Same statistics as :func:`vocab_parallel._math.shard_stats` for all rows at once.

    Args:
        logits: [B, R, V] or [N, V], any float dtype (not modified, never copied to fp32).
        inv_temperature: 1 / temperature; the statistics are of z = logits * inv_temperature.
        entropy: also return sum exp(z - shift) * (z - shift).
        sum_z: also return the plain sum of z.

    Returns:
        statistics of the N = B * R rows, [N] each.
    """
    x = _slabs(logits)
    slabs, rows, v = x.shape
    n = slabs * rows
    out = torch.empty((4, n), device=x.device, dtype=torch.float32)
    if n and v:
        block, warps = _launch_config(v)
        with on_device(x):
            _stats_kernel[(n,)](
                x,
                x.stride(0),
                x.stride(1),
                rows,
                v,
                inv_temperature,
                out[0],
                out[1],
                out[2],
                out[3],
                WANT_ENTROPY=entropy,
                WANT_SUM_Z=sum_z,
                LOG_FLOOR=LOG_FLOOR,
                BLOCK=block,
                num_warps=warps,
            )
    elif n:
        out[0].fill_(float("-inf"))
        out[1:].zero_()
    return ShardStats(
        max=out[0],
        sum_exp=out[1],
        sum_exp_z=out[2] if entropy else None,
        sum_z=out[3] if sum_z else None,
    )


def logits_grad(
    logits: Tensor,
    terms: GradTerms,
    *,
    inv_temperature: float,
    inv_vocab: float,
    in_place: bool = False,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Gradient w.r.t. the logits ([B, R, V] or [N, V]) in their shape.

    See :func:`_math.chunk_grad`; ``terms`` are [N]. ``in_place`` overwrites the logits with
    their gradient, in their layout (each program reads a stretch of its row before writing it
    back), saving one buffer; otherwise the gradient is a new contiguous tensor of
    ``out_dtype`` (default: the logits' dtype).
    """
    x = _slabs(logits)
    slabs, rows, v = x.shape
    n = slabs * rows
    if in_place and x.data_ptr() == logits.data_ptr() and out_dtype in (None, x.dtype):
        grad = x
    else:
        grad = x.new_empty(x.shape, dtype=out_dtype or x.dtype)
    if n == 0 or v == 0:
        return logits if grad is x else grad.view(logits.shape)
    dummy = terms.log_normalizer

    def arg(t: Tensor | None) -> Tensor:
        return t.contiguous() if t is not None else dummy

    block, warps = _launch_config(v)
    has_target = (
        terms.grad_all is not None
        and terms.target_index is not None
        and terms.target_grad is not None
    )
    with on_device(x):
        _grad_kernel[(n,)](
            x,
            x.stride(0),
            x.stride(1),
            rows,
            grad,
            grad.stride(0),
            grad.stride(1),
            v,
            inv_temperature,
            inv_vocab,
            arg(terms.log_normalizer),
            arg(terms.entropy),
            arg(terms.grad_all),
            arg(terms.grad_entropy),
            arg(terms.grad_uniform),
            arg(terms.target_index),
            arg(terms.target_grad),
            HAS_TARGET=has_target,
            HAS_ENTROPY=terms.grad_entropy is not None,
            HAS_UNIFORM=terms.grad_uniform is not None,
            LOG_FLOOR=LOG_FLOOR,
            BLOCK=block,
            num_warps=warps,
        )
    if grad is x:
        # Written through the logits' own strides: hand back the caller's tensor itself.
        return logits
    return grad.view(logits.shape)
