"""Token layouts: which global positions of the padded sequence each context-parallel rank holds.

Pure index math on CPU/any-device tensors; no process group is touched here. Every layout is an
exact partition of ``range(P)``: concatenating the per-rank index vectors in rank order gives a
permutation of ``0..P-1``, and :func:`inverse_permutation` of that concatenation restores the
global order exactly.

Dimension letters: P padded length, W cp size, r rank, c chunk length, N packed sequences.
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

__all__ = [
    "LayoutKind",
    "all_rank_indices",
    "check_partition",
    "contiguous_indices",
    "head_tail_indices",
    "identity_indices",
    "inverse_permutation",
    "rank_indices",
    "round_up",
    "thd_partitioned_indices",
]


class LayoutKind(enum.Enum):
    """How the padded sequence is split across context-parallel ranks.

    Attributes:
        IDENTITY: cp=1; the single rank holds ``0..P-1`` in order.
        CONTIGUOUS: rank r holds ``[r*P/W, (r+1)*P/W)``.
        HEAD_TAIL: rank r holds chunk r then chunk 2W-1-r of 2W equal chunks (load-balanced for
            causal attention; torch's head-tail load balancer and Megatron's chunking).
        THD: per packed sequence, rank r holds that sequence's chunks r and 2W-1-r (Transformer
            Engine's ``thd_get_partitioned_indices``).
    """

    IDENTITY = "identity"
    CONTIGUOUS = "contiguous"
    HEAD_TAIL = "head_tail"
    THD = "thd"


def round_up(length: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``length``."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-length // multiple) * multiple


def _check_rank(cp: int, rank: int) -> None:
    if cp < 1:
        raise ValueError(f"cp size must be >= 1, got {cp}")
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside [0, {cp}) for cp size {cp}")


def identity_indices(length: int, *, device: torch.device | str | None = None) -> Tensor:
    """``[P]`` int64 ``0..P-1``: the layout of a single rank (cp=1)."""
    return torch.arange(length, dtype=torch.int64, device=device)


def contiguous_indices(
    padded_len: int, cp: int, rank: int, *, device: torch.device | str | None = None
) -> Tensor:
    """``[P/W]`` int64 global positions of rank ``rank`` in the contiguous layout.

    Raises:
        ValueError: ``padded_len`` is not divisible by ``cp``.
    """
    _check_rank(cp, rank)
    if padded_len % cp:
        raise ValueError(
            f"padded length {padded_len} is not divisible by cp={cp} for the contiguous layout; "
            f"pad the sequence to a multiple of {cp}"
        )
    local = padded_len // cp
    return torch.arange(rank * local, (rank + 1) * local, dtype=torch.int64, device=device)


def head_tail_indices(
    padded_len: int, cp: int, rank: int, *, device: torch.device | str | None = None
) -> Tensor:
    """``[P/W]`` int64 global positions of rank ``rank`` in the head/tail layout.

    With ``c = P / 2W``, the local order is ``[r*c, (r+1)*c) ++ [(2W-1-r)*c, (2W-r)*c)``.

    Raises:
        ValueError: ``padded_len`` is not divisible by ``2*cp``.
    """
    _check_rank(cp, rank)
    if padded_len % (2 * cp):
        raise ValueError(
            f"padded length {padded_len} is not divisible by 2*cp={2 * cp} for the head/tail "
            f"layout; pad the sequence to a multiple of {2 * cp}"
        )
    chunk = padded_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.int64, device=device)
    tail_start = (2 * cp - 1 - rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, dtype=torch.int64, device=device)
    return torch.cat([head, tail])


def _check_cu_seqlens(cu_seqlens_padded: Tensor, total_tokens: int, cp: int) -> Tensor:
    cu = cu_seqlens_padded.detach().to(device="cpu", dtype=torch.int64).reshape(-1)
    if cu.numel() < 2 or int(cu[0]) != 0:
        raise ValueError(
            f"cu_seqlens_padded must start at 0 and hold at least one sequence, got {cu.tolist()}"
        )
    lengths = cu.diff()
    if bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens_padded must be non-decreasing, got {cu.tolist()}")
    if int(cu[-1]) != total_tokens:
        raise ValueError(
            f"cu_seqlens_padded ends at {int(cu[-1])} but the stream holds {total_tokens} tokens; "
            "describe every token (put trailing padding in a last padded sequence)"
        )
    bad = (lengths % (2 * cp)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"packed sequence {i} has padded length {int(lengths[i])}, not divisible by "
            f"2*cp={2 * cp} as the THD layout requires; pad each packed sequence to a multiple "
            f"of {2 * cp} (energon-sft: pad_to_multiple_of={2 * cp})"
        )
    return cu


def thd_partitioned_indices(
    cu_seqlens_padded: Tensor, total_tokens: int, cp: int, rank: int
) -> Tensor:
    """``[T/W]`` int64 global token indices of rank ``rank`` in the THD layout.

    The closed form of Transformer Engine's ``thd_get_partitioned_indices``: local token t lies in
    the sequence s with ``cu[s]/W <= t < cu[s+1]/W``; with ``L = (cu[s+1]-cu[s])/W`` and
    ``i = t - cu[s]/W`` its global index is ``cu[s] + i + (L/2) * (r if i < L/2 else 2W-2-r)``,
    i.e. chunk r then chunk 2W-1-r of that sequence.

    Args:
        cu_seqlens_padded: [N+1] cumulative padded sequence lengths, starting at 0 and ending at
            ``total_tokens``; every padded length divisible by ``2*cp``.
        total_tokens: T, the length of the packed stream.
        cp: W.
        rank: r.

    Raises:
        ValueError: a sequence length not divisible by 2*cp, or boundaries not covering T.
    """
    _check_rank(cp, rank)
    cu = _check_cu_seqlens(cu_seqlens_padded, total_tokens, cp)
    local_cu = cu // cp
    t = torch.arange(total_tokens // cp, dtype=torch.int64)
    # Index of the sequence holding local token t (empty sequences are skipped by right=True).
    seq = torch.searchsorted(local_cu[1:], t, right=True).clamp_(max=local_cu.numel() - 2)
    start = local_cu[seq]
    index = t - start
    half = (local_cu[seq + 1] - start) // 2
    offset = torch.where(index < half, rank, 2 * cp - 2 - rank)
    return (index + start * cp + half * offset).to(cu_seqlens_padded.device)


def rank_indices(
    kind: LayoutKind,
    *,
    padded_len: int,
    cp: int,
    rank: int,
    cu_seqlens_padded: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """``[P/W]`` int64 global positions held by ``rank`` under layout ``kind``."""
    if kind is LayoutKind.IDENTITY:
        if cp != 1:
            raise ValueError(f"the identity layout is for cp=1, got cp={cp}")
        return identity_indices(padded_len, device=device)
    if kind is LayoutKind.CONTIGUOUS:
        return contiguous_indices(padded_len, cp, rank, device=device)
    if kind is LayoutKind.HEAD_TAIL:
        return head_tail_indices(padded_len, cp, rank, device=device)
    if cu_seqlens_padded is None:
        raise ValueError("the THD layout needs cu_seqlens_padded")
    return thd_partitioned_indices(cu_seqlens_padded, padded_len, cp, rank).to(device)


def all_rank_indices(
    kind: LayoutKind,
    *,
    padded_len: int,
    cp: int,
    cu_seqlens_padded: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """``[W, P/W]`` int64: row r is :func:`rank_indices` of rank r. Computed locally, no comms."""
    return torch.stack(
        [
            rank_indices(
                kind,
                padded_len=padded_len,
                cp=cp,
                rank=r,
                cu_seqlens_padded=cu_seqlens_padded,
                device=device,
            )
            for r in range(cp)
        ]
    )


def inverse_permutation(permutation: Tensor) -> Tensor:
    """``[P]`` int64 inverse of a permutation: ``x[perm][inverse_permutation(perm)] == x``.

    Built by a scatter (exact, O(P)), not a sort.
    """
    flat = permutation.reshape(-1)
    inverse = torch.empty_like(flat)
    inverse[flat] = torch.arange(flat.numel(), dtype=flat.dtype, device=flat.device)
    return inverse


def check_partition(indices: Tensor, padded_len: int) -> None:
    """Raise unless ``indices`` (any shape) is a permutation of ``0..padded_len-1``."""
    flat = indices.reshape(-1)
    if flat.numel() != padded_len:
        raise ValueError(f"layout holds {flat.numel()} indices, expected {padded_len}")
    counts = torch.bincount(flat.cpu(), minlength=padded_len)
    if counts.numel() != padded_len or not bool((counts == 1).all()):
        raise ValueError(f"layout indices are not a partition of range({padded_len})")
