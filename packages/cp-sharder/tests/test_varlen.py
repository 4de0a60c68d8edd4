"""The varlen kernel and the packed-attention runs against dense float64 references (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_sharder import layouts
from cp_sharder.attention import varlen
from cp_sharder.attention.packed import plan_runs
from cp_sharder.layouts import LayoutKind


def _dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """Explicit softmax over a dense [T, T] document mask (the thing the kernel avoids)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (scale or 1 / math.sqrt(q.shape[-1]))
    i = torch.arange(q.shape[0])[:, None]
    j = torch.arange(q.shape[0])[None, :]
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (i - j < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _random_docs(gen: torch.Generator, count: int, longest: int) -> list[int]:
    return torch.randint(1, longest + 1, (count,), generator=gen).tolist()


@pytest.mark.parametrize(
    ("causal", "window", "scale", "kv_heads"),
    [(True, None, None, 2), (True, 3, 0.3, 4), (False, None, None, 1), (True, None, None, 4)],
)
def test_kernel_matches_dense_reference_forward_and_backward(
    causal: bool, window: int | None, scale: float | None, kv_heads: int
) -> None:
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        lengths = _random_docs(gen, 5, 9)
        total = sum(lengths)
        q = torch.randn(total, 4, 8, dtype=torch.float64, generator=gen, requires_grad=True)
        k = torch.randn(total, kv_heads, 8, dtype=torch.float64, generator=gen, requires_grad=True)
        v = torch.randn(total, kv_heads, 8, dtype=torch.float64, generator=gen, requires_grad=True)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        segments = varlen.Segments(
            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths)
        )
        out = varlen.varlen_attention(
            q,
            k,
            v,
            segments,
            causal=causal,
            scale=scale,
            window=window,
        )
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref = _dense_reference(*leaves, doc, causal=causal, window=window, scale=scale)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        up = torch.randn(out.shape, dtype=torch.float64, generator=gen)
        (out * up).sum().backward()
        (ref * up).sum().backward()
        for got, want in zip((q, k, v), leaves, strict=True):
            assert got.grad is not None and want.grad is not None
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-10)


def test_suffix_queries_are_bottom_right_aligned() -> None:
    """Queries that are the last Lq of a segment's keys see the keys up to themselves."""
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(10, 2, 8, dtype=torch.float64, generator=gen)
    values = torch.randn(10, 2, 8, dtype=torch.float64, generator=gen)
    query = torch.randn(10, 2, 8, dtype=torch.float64, generator=gen)
    full = _dense_reference(
        query, keys, values, torch.zeros(10), causal=True, window=None, scale=None
    )
    # Segment 0: queries 6..9 over keys 0..9; segment 1: queries 2..3 over keys 0..3.
    q = torch.cat([query[6:10], query[2:4]])
    k = torch.cat([keys, keys[:4]])
    v = torch.cat([values, values[:4]])
    segments = varlen.Segments(
        cu_seqlens_q=torch.tensor([0, 4, 6]),
        cu_seqlens_k=torch.tensor([0, 10, 14]),
        max_seqlen_q=4,
        max_seqlen_k=10,
    )
    out = varlen.varlen_attention(q, k, v, segments)
    torch.testing.assert_close(out, torch.cat([full[6:10], full[2:4]]), rtol=1e-12, atol=1e-12)


def test_kernel_rejects_bad_shapes() -> None:
    q = torch.randn(6, 3, 8)
    cu = torch.tensor([0, 6])
    segments = varlen.Segments(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    with pytest.raises(ValueError, match=r"THD tensors \[T, H, D\]"):
        varlen.varlen_attention(q[None], q, q, segments)
    kv = torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match="dividing the query heads"):
        varlen.varlen_attention(q, kv, kv, segments)


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([2, 4]),
    st.lists(st.integers(min_value=1, max_value=13), min_size=1, max_size=6),
    st.booleans(),
)
def test_cp_runs_reproduce_global_causal_attention(
    cp: int, lengths: list[int], per_doc: bool
) -> None:
    """Every rank's runs (head/tail over the stream, or per document) give exactly its rows of
    global per-document causal attention; pure index math plus the kernel, no processes."""
    if per_doc:
        lengths = [layouts.round_up(n, 2 * cp) for n in lengths]
    total = layouts.round_up(sum(lengths), 2 * cp)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    seg = torch.cat([seg, torch.full((total - seg.numel(),), len(lengths))])[None]
    if per_doc and total == sum(lengths):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        kind = LayoutKind.THD
    else:
        cu, kind = None, LayoutKind.HEAD_TAIL
    table = layouts.all_rank_indices(kind, padded_len=total, cp=cp, cu_seqlens_padded=cu)
    inverse = layouts.inverse_permutation(table.flatten())
    gen = torch.Generator().manual_seed(sum(lengths))
    q, k, v = (torch.randn(total, 2, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    ref = _dense_reference(q, k, v, seg[0], causal=True, window=None, scale=None)
    gathered_k, gathered_v = k[table.flatten()], v[table.flatten()]  # rank order
    for rank in range(cp):
        mine = table[rank]
        plan = plan_runs(seg, mine, inverse, rows=1, causal=True)
        assert plan.kv_index is not None
        # Each document meets a rank in at most two runs (head and tail).
        assert plan.cu_seqlens_q.numel() - 1 <= 2 * (len(lengths) + 1)
        out = varlen.varlen_attention(
            q[mine], gathered_k[plan.kv_index], gathered_v[plan.kv_index], plan
        )
        torch.testing.assert_close(out, ref[mine], rtol=1e-10, atol=1e-10)


def test_cp1_plan_reuses_the_query_segments() -> None:
    seg = torch.tensor([[0, 0, 0, 1, 1, 2]])
    plan = plan_runs(seg, torch.arange(6), torch.arange(6), rows=1, causal=True)
    assert plan.kv_index is None
    assert plan.cu_seqlens_k is plan.cu_seqlens_q
    assert plan.cu_seqlens_q.tolist() == [0, 3, 5, 6]
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (3, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen_attn runs on CUDA")
@pytest.mark.skipif(not varlen.torch_varlen_available(), reason="this torch has no varlen_attn")
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_torch_varlen_on_cuda_matches_the_reference(kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [37, 5, 64, 20]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v = (
        torch.randn(total, h, 64, dtype=torch.float64, generator=gen)
        for h in (4, kv_heads, kv_heads)
    )
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ref = _dense_reference(q, k, v, doc, causal=True, window=None, scale=None)
    leaves = [t.cuda().bfloat16().requires_grad_() for t in (q, k, v)]
    assert varlen._use_torch_varlen(leaves[0], None)
    segments = varlen.Segments(
        cu_seqlens_q=cu.cuda(), cu_seqlens_k=cu.cuda(), max_seqlen_q=64, max_seqlen_k=64
    )
    out = varlen.varlen_attention(*leaves, segments)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=3e-2, atol=3e-2)
    out.float().sum().backward()
    assert all(t.grad is not None and bool(t.grad.isfinite().all()) for t in leaves)
    # Suffix queries (CP chunks) are bottom-right aligned on this kernel too.
    tail_segments = varlen.Segments(
        cu_seqlens_q=torch.tensor([0, 7], device="cuda"),
        cu_seqlens_k=torch.tensor([0, 37], device="cuda"),
        max_seqlen_q=7,
        max_seqlen_k=37,
    )
    tail = varlen.varlen_attention(leaves[0][30:37], leaves[1][:37], leaves[2][:37], tail_segments)
    torch.testing.assert_close(tail.double().cpu(), ref[30:37], rtol=3e-2, atol=3e-2)
