"""Property tests of the pure layout math (no process group)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_sharder import layouts
from cp_sharder.layouts import LayoutKind

SETTINGS = settings(max_examples=60, deadline=None)

cp_sizes = st.sampled_from([1, 2, 3, 4, 8])


@st.composite
def cp_and_length(draw: st.DrawFn) -> tuple[int, int, int]:
    """(cp, original length, padded length to a multiple of 2*cp)."""
    cp = draw(cp_sizes)
    length = draw(st.integers(min_value=1, max_value=200))
    return cp, length, layouts.round_up(length, 2 * cp)


@st.composite
def packed(draw: st.DrawFn) -> tuple[int, torch.Tensor]:
    """(cp, cu_seqlens_padded) with every padded length a multiple of 2*cp (zero allowed)."""
    cp = draw(cp_sizes)
    units = draw(st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=8))
    if sum(units) == 0:
        units[0] = 1
    lens = torch.tensor(units, dtype=torch.int64) * 2 * cp
    return cp, torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])


def _te_kernel_reference(cu: list[int], total: int, world: int, rank: int) -> list[int]:
    """Scalar transliteration of TE's thd_partition_indices_kernel loop (binary search included)."""
    cu_s = [c // world for c in cu]
    batch = len(cu) - 1
    out = []
    for token in range(total // world):
        left, right = 1, batch
        while left < right:
            mid = (left + right) // 2
            if cu_s[mid] <= token:
                left = mid + 1
            else:
                right = mid
        seq = left - 1
        seq_len = cu_s[seq + 1] - cu_s[seq]
        index = token - cu_s[seq]
        offset = rank if index < seq_len // 2 else (world - 1) * 2 - rank
        out.append(index + cu_s[seq] * world + seq_len // 2 * offset)
    return out


def _per_sequence_chunks(cu: list[int], world: int, rank: int) -> list[int]:
    """The documented meaning: per sequence, chunk r then chunk 2W-1-r."""
    out: list[int] = []
    for start, end in itertools.pairwise(cu):
        chunk = (end - start) // (2 * world)
        out += range(start + rank * chunk, start + (rank + 1) * chunk)
        tail = start + (2 * world - 1 - rank) * chunk
        out += range(tail, tail + chunk)
    return out


@SETTINGS
@given(cp_and_length())
def test_every_layout_partitions_the_padded_positions(case: tuple[int, int, int]) -> None:
    cp, _, padded = case
    for kind in (LayoutKind.CONTIGUOUS, LayoutKind.HEAD_TAIL):
        table = layouts.all_rank_indices(kind, padded_len=padded, cp=cp)
        assert table.shape == (cp, padded // cp)
        assert torch.equal(table.flatten().sort().values, torch.arange(padded)), kind
        layouts.check_partition(table, padded)
    ident = layouts.all_rank_indices(LayoutKind.IDENTITY, padded_len=padded, cp=1)
    assert torch.equal(ident[0], torch.arange(padded))


@SETTINGS
@given(cp_and_length(), st.integers(min_value=1, max_value=3))
def test_gather_of_shard_is_identity_and_trim_restores(
    case: tuple[int, int, int], width: int
) -> None:
    cp, length, padded = case
    x = torch.randn(2, length, width, dtype=torch.float64)
    xp = torch.nn.functional.pad(x, (0, 0, 0, padded - length))
    for kind in (LayoutKind.CONTIGUOUS, LayoutKind.HEAD_TAIL):
        table = layouts.all_rank_indices(kind, padded_len=padded, cp=cp)
        shards = [xp.index_select(1, table[r]) for r in range(cp)]
        gathered = torch.cat(shards, dim=1)  # what an all-gather returns, rank order
        restored = gathered.index_select(1, layouts.inverse_permutation(table.flatten()))
        assert torch.equal(restored, xp)
        assert torch.equal(restored[:, :length], x)


@SETTINGS
@given(cp_and_length())
def test_head_tail_equals_torch_and_megatron(case: tuple[int, int, int]) -> None:
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )

    cp, _, padded = case
    torch_order = _HeadTailLoadBalancer(padded, cp, "cpu")._generate_indices()[0].long()
    chunk = padded // (2 * cp)
    for rank in range(cp):
        ours = layouts.head_tail_indices(padded, cp, rank)
        local = padded // cp
        assert torch.equal(ours, torch_order[rank * local : (rank + 1) * local]), rank
        # Megatron get_batch_on_this_cp_rank: view [2W, c], select chunks r and 2W-1-r.
        megatron = (
            torch.arange(padded)
            .view(2 * cp, chunk)
            .index_select(0, torch.tensor([rank, 2 * cp - 1 - rank]))
        ).flatten()
        assert torch.equal(ours, megatron), rank


@SETTINGS
@given(cp_and_length())
def test_head_tail_balances_causal_work(case: tuple[int, int, int]) -> None:
    cp, _, padded = case
    table = layouts.all_rank_indices(LayoutKind.HEAD_TAIL, padded_len=padded, cp=cp)
    # A query at global position i attends to i + 1 keys under a causal mask.
    work = (table + 1).sum(dim=1)
    assert bool((work == work[0]).all()), work.tolist()


@SETTINGS
@given(packed())
def test_thd_equals_te_formula_and_partitions(case: tuple[int, torch.Tensor]) -> None:
    cp, cu = case
    total = int(cu[-1])
    table = layouts.all_rank_indices(LayoutKind.THD, padded_len=total, cp=cp, cu_seqlens_padded=cu)
    layouts.check_partition(table, total)
    for rank in range(cp):
        ours = layouts.thd_partitioned_indices(cu.to(torch.int32), total, cp, rank).tolist()
        assert ours == _te_kernel_reference(cu.tolist(), total, cp, rank)
        assert ours == _per_sequence_chunks(cu.tolist(), cp, rank)


def test_thd_local_cu_seqlens_are_global_over_cp() -> None:
    cu = torch.tensor([0, 8, 24, 32])
    idx = layouts.thd_partitioned_indices(cu, 32, 2, 1)
    # Rank 1's tokens of sequence s occupy local slots [cu[s]/2, cu[s+1]/2).
    assert idx[:4].tolist() == [2, 3, 4, 5]
    assert idx[4:12].tolist() == [12, 13, 14, 15, 16, 17, 18, 19]


def test_inverse_permutation_inverts() -> None:
    perm = torch.randperm(97)
    inv = layouts.inverse_permutation(perm)
    assert torch.equal(perm[inv], torch.arange(97))
    assert torch.equal(inv[perm], torch.arange(97))


def test_layout_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"not divisible by 2\*cp=4"):
        layouts.head_tail_indices(10, 2, 0)
    with pytest.raises(ValueError, match="not divisible by cp=3"):
        layouts.contiguous_indices(10, 3, 0)
    with pytest.raises(ValueError, match=r"packed sequence 1 has padded length 6"):
        layouts.thd_partitioned_indices(torch.tensor([0, 8, 14, 16]), 16, 2, 0)
    with pytest.raises(ValueError, match="ends at 8 but the stream holds 16"):
        layouts.thd_partitioned_indices(torch.tensor([0, 8]), 16, 2, 0)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        layouts.head_tail_indices(8, 2, 2)
    with pytest.raises(ValueError, match="not a partition"):
        layouts.check_partition(torch.tensor([0, 0, 1, 2]), 4)
    with pytest.raises(ValueError, match="identity layout is for cp=1"):
        layouts.rank_indices(LayoutKind.IDENTITY, padded_len=8, cp=2, rank=0)
