# mypy: disable-error-code="no-untyped-def"
"""Triton matmul kernels of the fused linear log-prob, with the softmax work in the epilogue.

# N tokens, H hidden (the matmul's reduction dim), V local vocabulary rows, Vb rows per backward
# block; a program computes one [BM, BN] tile of logits = hidden @ weight.T in fp32 registers.

Forward never writes the logits: each tile leaves its per-token max and sum of exponentials
([N] per vocabulary tile) and, where a token's label falls inside it, the target logit. Backward
recomputes a block of tiles and writes only their logits gradient (in the input dtype), which
two cuBLAS matmuls then turn into the hidden and weight gradients. Against cuBLAS matmuls plus
separate softmax kernels this removes one write and one read of the logits in forward, and one
read and one write in backward.

Imported lazily, like :mod:`vocab_parallel._triton`; runs under ``TRITON_INTERPRET=1`` on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from vocab_parallel._math import ShardStats
from vocab_parallel._triton import _on_device, interpreting


@dataclass(kw_only=True, slots=True, frozen=True)
class TileConfig:
    """Launch configuration of the linear kernels.

    Attributes:
        block_m: tokens per tile (BM).
        block_n: vocabulary rows per tile (BN).
        block_k: hidden features per step of the reduction (BK).
        group_m: token tiles that share a band of vocabulary tiles, for L2 reuse of the weight.
        stages: software-pipeline depth of the reduction loop.
        warps: warps per program.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    stages: int
    warps: int


# Measured on an H200 (bf16, H=4096, V=151936): see packages/vocab-parallel/bench/linear_kernels.py.
FORWARD_CONFIG = TileConfig(block_m=128, block_n=256, block_k=64, group_m=8, stages=3, warps=8)
BACKWARD_CONFIG = TileConfig(block_m=128, block_n=256, block_k=64, group_m=8, stages=3, warps=8)
# The interpreter runs tiles as numpy arrays: small tiles keep the CPU tests fast.
_INTERPRETER_CONFIG = TileConfig(block_m=16, block_n=32, block_k=16, group_m=2, stages=1, warps=1)


@triton.jit
def _tile_logits(
    h_ptr,
    w_ptr,
    n_rows,
    n_cols,
    k_dim,
    stride_h,
    stride_w,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """fp32 [BM, BN] tile of hidden @ weight.T for this program, with its row and column ids."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(n_rows, BM)
    tiles_n = tl.cdiv(n_cols, BN)
    # Grouped order: GROUP_M token tiles walk the same vocabulary tiles together, so a band of
    # the weight is read from DRAM once per group instead of once per token tile.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    # Out-of-range rows/columns read a valid row (wrapped); their results are masked later, so
    # the reduction loop needs no load masks.
    safe_rows = (rows % n_rows).to(tl.int64)
    safe_cols = (cols % n_cols).to(tl.int64)
    ks = tl.arange(0, BK)
    a_ptrs = h_ptr + safe_rows[:, None] * stride_h + ks[None, :]
    b_ptrs = w_ptr + safe_cols[:, None] * stride_w + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_dim, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = ks < k_dim - k * BK
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BK
        b_ptrs += BK
    return acc, rows, cols, pid_n


@triton.jit
def _stats_kernel(
    h_ptr,
    w_ptr,
    target_col_ptr,
    part_max_ptr,
    part_sum_ptr,
    target_ptr,
    n_rows,
    n_cols,
    k_dim,
    stride_h,
    stride_w,
    inv_t,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    acc, rows, cols, pid_n = _tile_logits(
        h_ptr, w_ptr, n_rows, n_cols, k_dim, stride_h, stride_w, BM, BN, BK, GROUP_M, EVEN_K, UPCAST
    )
    z = tl.where((cols < n_cols)[None, :], acc * inv_t, float("-inf"))
    tile_max = tl.max(z, 1)
    # Every tile holds at least one real column, so tile_max is finite unless the logits are
    # not; the shift keeps an all -inf row at sum 0 instead of nan.
    shift = tl.where(tile_max == float("-inf"), 0.0, tile_max)
    tile_sum = tl.sum(tl.exp(z - shift[:, None]), 1)
    row_ok = rows < n_rows
    slot = pid_n.to(tl.int64) * n_rows + rows
    tl.store(part_max_ptr + slot, tile_max, mask=row_ok)
    tl.store(part_sum_ptr + slot, tile_sum, mask=row_ok)
    target_col = tl.load(target_col_ptr + rows, mask=row_ok, other=-1)
    picked = tl.sum(tl.where(cols[None, :] == target_col[:, None], z, 0.0), 1)
    here = row_ok & (target_col >= pid_n * BN) & (target_col < pid_n * BN + BN)
    tl.store(target_ptr + rows, picked, mask=here)


@triton.jit
def _grad_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    log_z_ptr,
    g_all_ptr,
    target_col_ptr,
    target_grad_ptr,
    col_offset,
    n_rows,
    n_cols,
    k_dim,
    stride_h,
    stride_w,
    inv_t,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # d log p(target) / dz_v = onehot_v - p_v, scaled per token by the upstream gradient.
    acc, rows, cols, _ = _tile_logits(
        h_ptr, w_ptr, n_rows, n_cols, k_dim, stride_h, stride_w, BM, BN, BK, GROUP_M, EVEN_K, UPCAST
    )
    row_ok = rows < n_rows
    log_z = tl.load(log_z_ptr + rows, mask=row_ok, other=0.0)
    g_all = tl.load(g_all_ptr + rows, mask=row_ok, other=0.0)
    target_col = tl.load(target_col_ptr + rows, mask=row_ok, other=-1)
    target_grad = tl.load(target_grad_ptr + rows, mask=row_ok, other=0.0)
    p = tl.exp(acc * inv_t - log_z[:, None])
    grad = -p * g_all[:, None]
    grad += tl.where((cols + col_offset)[None, :] == target_col[:, None], target_grad[:, None], 0.0)
    out = out_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    tl.store(
        out, grad.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < n_cols)[None, :]
    )


def _config(config: TileConfig | None, default: TileConfig) -> TileConfig:
    if interpreting():
        return _INTERPRETER_CONFIG
    return config or default


def _launch_args(cfg: TileConfig, k_dim: int) -> dict[str, int | bool]:
    args: dict[str, int | bool] = dict(
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        GROUP_M=cfg.group_m,
        EVEN_K=k_dim % cfg.block_k == 0,
        # The interpreter's dot mishandles 16-bit inputs; fp32 products of them are exact.
        UPCAST=interpreting(),
    )
    if not interpreting():
        args.update(num_stages=cfg.stages, num_warps=cfg.warps)
    return args


def _grid(rows: int, cols: int, cfg: TileConfig) -> tuple[int]:
    return (triton.cdiv(rows, cfg.block_m) * triton.cdiv(cols, cfg.block_n),)


def _unit_stride(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def linear_stats(
    hidden: Tensor,
    weight: Tensor,
    *,
    target_col: Tensor,
    inv_temperature: float,
    config: TileConfig | None = None,
) -> tuple[ShardStats, Tensor]:
    """Softmax statistics of z = hidden @ weight.T * inv_temperature without writing z.

    Args:
        hidden: [N, H] bf16/fp16.
        weight: [V, H] same dtype (the local vocabulary rows).
        target_col: [N] int64 local column of each token's label, -1 where it is not here.
        inv_temperature: scale applied to the fp32 logits.
        config: tile configuration (default: :data:`FORWARD_CONFIG`).

    Returns:
        (statistics over the V columns, [N] each; the target's scaled logit, fp32 [N], 0 where
        target_col is -1).
    """
    hidden, weight = _unit_stride(hidden), _unit_stride(weight)
    n, k_dim = hidden.shape
    v = weight.shape[0]
    cfg = _config(config, FORWARD_CONFIG)
    tiles_n = triton.cdiv(v, cfg.block_n)
    part_max = torch.empty((tiles_n, n), device=hidden.device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    target = torch.zeros(n, device=hidden.device, dtype=torch.float32)
    if n and v:
        with _on_device(hidden):
            _stats_kernel[_grid(n, v, cfg)](
                hidden,
                weight,
                target_col.contiguous(),
                part_max,
                part_sum,
                target,
                n,
                v,
                k_dim,
                hidden.stride(0),
                weight.stride(0),
                inv_temperature,
                **_launch_args(cfg, k_dim),
            )
    if v == 0 or n == 0:
        stats = ShardStats(
            max=torch.full((n,), float("-inf"), device=hidden.device),
            sum_exp=torch.zeros(n, device=hidden.device),
            sum_exp_z=None,
            sum_z=None,
        )
        return stats, target
    row_max = part_max.amax(0)
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    sum_exp = (part_sum * torch.exp(part_max - shift)).sum(0)
    return ShardStats(max=row_max, sum_exp=sum_exp, sum_exp_z=None, sum_z=None), target


def linear_logits_grad(
    hidden: Tensor,
    weight_rows: Tensor,
    *,
    out: Tensor,
    col_offset: int,
    inv_temperature: float,
    log_normalizer: Tensor,
    grad_all: Tensor,
    target_col: Tensor,
    target_grad: Tensor,
    config: TileConfig | None = None,
) -> Tensor:
    """Gradient of sum_t g_t log p_t w.r.t. one block of logits, recomputed from the inputs.

    Args:
        hidden: [N, H] bf16/fp16.
        weight_rows: [Vb, H] the block's vocabulary rows (local columns col_offset + [0, Vb)).
        out: [N, Vb] contiguous buffer in the input dtype, overwritten with the gradient.
        col_offset: local column of the block's first row.
        inv_temperature: scale of the logits.
        log_normalizer: [N] fp32 log Z of the scaled logits over the whole vocabulary.
        grad_all: [N] fp32 upstream gradient times inv_temperature (0 for ignored tokens).
        target_col: [N] int64 local column of the label, -1 where it is not on this rank.
        target_grad: [N] fp32 the onehot term's weight (grad_all where the label is here).
        config: tile configuration (default: :data:`BACKWARD_CONFIG`).

    Returns:
        ``out``.
    """
    hidden, weight_rows = _unit_stride(hidden), _unit_stride(weight_rows)
    n, k_dim = hidden.shape
    v = weight_rows.shape[0]
    if out.shape != (n, v) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{n}, {v}] buffer, got {tuple(out.shape)}")
    cfg = _config(config, BACKWARD_CONFIG)
    if n and v:
        with _on_device(hidden):
            _grad_kernel[_grid(n, v, cfg)](
                hidden,
                weight_rows,
                out,
                log_normalizer.contiguous(),
                grad_all.contiguous(),
                target_col.contiguous(),
                target_grad.contiguous(),
                col_offset,
                n,
                v,
                k_dim,
                hidden.stride(0),
                weight_rows.stride(0),
                inv_temperature,
                **_launch_args(cfg, k_dim),
            )
    return out
