# mypy: disable-error-code="no-untyped-def"
"""accumulator [M, N] += a.T @ b in one Triton kernel, for the fused loss's weight gradient.

# K rows of a and b (a chunk's tokens), M columns of a (vocabulary rows), N columns of b (hidden)

Each chunk of the grads-in-forward loss adds grad_logits.T [Vl, C] @ h_chunk [C, H] to the
[Vl, H] weight gradient. K = C is short (a few hundred tokens) and the output is large, so the
read and write of the accumulator is a large part of the work; cuBLAS's accumulating kernel
for this shape ran 1.44x its time without the accumulation on an H200. Here each program owns
one output tile: it starts the tile's load of the old sum before its K loop, so the load
overlaps the loop's matmuls instead of following them, and it adds in fp32 and rounds once.

Imported lazily, like :mod:`vocab_parallel._triton`; runs under ``TRITON_INTERPRET=1`` on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from vocab_parallel._triton import _on_device, interpreting


@dataclass(kw_only=True, slots=True, frozen=True)
class AccConfig:
    """Tile shape and launch parameters of :func:`add_at_b_`.

    Attributes:
        block_m: output rows per program (vocabulary rows).
        block_n: output columns per program (hidden).
        block_k: rows of a and b per step of the K loop.
        group_m: row tiles walked together, so that programs running at once share b's columns
            and a's rows in L2.
        stages: software pipelining depth of the K loop.
        warps: warps per program.
        c_first: load the old tile before the K loop (else after it).
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    stages: int = 3
    warps: int = 8
    c_first: bool = True


DEFAULT_CONFIG = AccConfig()


@triton.jit
def _add_at_b_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_ak,
    stride_bk,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    C_FIRST: tl.constexpr,
    EVEN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # a is [K, M] and b is [K, N], both with unit stride along their columns; c is [M, N] with
    # unit stride along N. Program ids walk GROUP_M row tiles down a column of tiles before
    # moving right, so concurrent programs reuse the same b columns and a rows from L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + offs_k[None, :] * stride_ak + offs_m[:, None]  # [BLOCK_M, BLOCK_K] of a.T
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :]  # [BLOCK_K, BLOCK_N]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if C_FIRST:
        if EVEN:
            acc = tl.load(c_ptrs).to(tl.float32)
        else:
            acc = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=(offs_k[None, :] < left) & (offs_m[:, None] < M), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:  # the CPU interpreter's bf16 dot is wrong; bf16 -> fp32 is exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if not C_FIRST:
        if EVEN:
            acc += tl.load(c_ptrs).to(tl.float32)
        else:
            acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    out = acc.to(c_ptr.dtype.element_ty)
    if EVEN:
        tl.store(c_ptrs, out)
    else:
        tl.store(c_ptrs, out, mask=c_mask)


def add_at_b_(c: Tensor, a: Tensor, b: Tensor, *, config: AccConfig = DEFAULT_CONFIG) -> None:
    """Add a.T @ b to c in place, summed in fp32 and rounded once to c's dtype.

    Args:
        c: [M, N] with unit stride along N (modified).
        a: [K, M] with unit stride along M (a chunk of logits gradients: [C, Vl]).
        b: [K, N] with unit stride along N (the chunk's hidden states: [C, H]).
        config: tile shape and launch parameters.
    """
    k, m = a.shape
    n = b.shape[1]
    if b.shape[0] != k or c.shape != (m, n):
        raise ValueError(
            f"add_at_b_ needs a [K, M], b [K, N] and c [M, N]; got a {tuple(a.shape)}, "
            f"b {tuple(b.shape)}, c {tuple(c.shape)}"
        )
    if a.stride(1) != 1 or b.stride(1) != 1 or c.stride(1) != 1:
        raise ValueError("add_at_b_ needs unit stride along the last dimension of a, b and c")
    if k == 0 or m == 0 or n == 0:
        return
    cfg = config
    even = m % cfg.block_m == 0 and n % cfg.block_n == 0 and k % cfg.block_k == 0
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    with _on_device(c):
        _add_at_b_kernel[grid](
            a,
            b,
            c,
            m,
            n,
            k,
            a.stride(0),
            b.stride(0),
            c.stride(0),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            C_FIRST=cfg.c_first,
            EVEN=even,
            UPCAST=interpreting(),
            num_warps=cfg.warps,
            num_stages=cfg.stages,
        )
