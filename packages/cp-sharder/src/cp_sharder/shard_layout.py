"""Where a rank's tokens sit: the layout of one sharded batch, and the token verbs on it.

``ContextParallelSharder.shard`` plans a batch and records its :class:`ShardLayout`; the
functions here move any token-aligned tensor into that layout (:func:`shard_tokens`, no
collective) and back into global order (:func:`gather_tokens`, one all-gather over the CP
group). The index math itself is :mod:`cp_sharder.layouts`.

Dimension letters: B batch, S sequence (input), P padded sequence, W cp size, T packed tokens
(B*S).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from cp_sharder import layouts
from cp_sharder._dist import CPGroup, all_gather_seq
from cp_sharder._plan_common import SequencePlan, TrainContext, pad_tensor
from cp_sharder.attention import Backend

__all__ = ["ShardLayout", "ShardResult", "build_layout", "gather_tokens", "shard_tokens"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ShardLayout:
    """Where this rank's tokens sit in the padded global sequence, captured by ``shard()``.

    Attributes:
        sequence: the batch's layout kind, lengths, packed boundaries and label count, as
            planned (a :class:`~cp_sharder.planning.SequencePlan`): ``kind``,
            ``original_seq_len`` (S, or T = B*S for a packed batch), ``padded_seq_len`` (P),
            ``input_row_shape`` ((B, S) of a packed batch, else None), ``cu_seqlens_padded``
            ([N+1] int64 padded packed boundaries, else None) and ``num_label_tokens`` (label
            tokens of the pre-shard batch, this data-parallel rank only).
        cp_size: W.
        cp_rank: this rank.
        local_token_global_indices: [P/W] int64 global position of each local token, in local
            order.
        all_rank_indices: [W, P/W] int64, row r = rank r's global positions (computed locally).
        inverse_indices: [P] int64 inverse of ``all_rank_indices.flatten()``: gathered tokens in
            rank order, indexed by it, are in global order.
        backend: the attention backend the step's train_ctx enters.
    """

    sequence: SequencePlan
    cp_size: int
    cp_rank: int
    local_token_global_indices: Tensor
    all_rank_indices: Tensor
    inverse_indices: Tensor
    backend: Backend = Backend.NONE

    @property
    def local_seq_len(self) -> int:
        """P/W, the number of tokens each rank holds."""
        return self.sequence.padded_seq_len // self.cp_size


@dataclass(kw_only=True, slots=True, frozen=True)
class ShardResult:
    """What one ``shard()`` produced; unpacks as ``train_ctx, batch = sharder.shard(batch)``.

    Attributes:
        train_ctx: enter ``train_ctx()`` around the model call.
        batch: the keys the model's forward accepts, plus ``labels``; local token tensors are
            [B, P/W, ...] ([1, T_pad/W, ...] for packed batches).
        layout: where this rank's tokens sit; pass it to the token verbs.
        local_buffers: sharded token-aligned buffers the forward does not take (e.g. loss_mask).
    """

    train_ctx: TrainContext
    batch: dict[str, Any]
    layout: ShardLayout
    local_buffers: dict[str, Tensor] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Any]:
        yield self.train_ctx
        yield self.batch


def build_layout(
    sequence: SequencePlan, *, cp_size: int, cp_rank: int, backend: Backend
) -> ShardLayout:
    """The layout of a planned sequence on rank ``cp_rank`` of ``cp_size`` (pure index math)."""
    all_idx = layouts.all_rank_indices(
        sequence.kind,
        padded_len=sequence.padded_seq_len,
        cp=cp_size,
        cu_seqlens_padded=sequence.cu_seqlens_padded,
    )
    return ShardLayout(
        sequence=sequence,
        cp_size=cp_size,
        cp_rank=cp_rank,
        local_token_global_indices=all_idx[cp_rank],
        all_rank_indices=all_idx,
        inverse_indices=layouts.inverse_permutation(all_idx.reshape(-1)),
        backend=backend,
    )


def shard_tokens(
    t: Tensor, layout: ShardLayout, *, seq_dim: int = 1, fill: float | None = None
) -> Tensor:
    """This rank's part of a token-aligned tensor, in ``layout`` (out of place, no collective).

    See ``ContextParallelSharder.shard_token_tensor``.

    Args:
        t: [..., S or P, ...] (or [B, S, ...] for a packed batch).
        layout: the batch's layout.
        seq_dim: the sequence dimension.
        fill: pad value for the positions added by padding (needed when ``t`` has length S).

    Returns:
        [..., P/W, ...] ([1, P/W, ...] for a packed batch); differentiable.
    """
    sequence = layout.sequence
    if sequence.input_row_shape is not None and tuple(t.shape[:2]) == sequence.input_row_shape:
        t = t.reshape(1, sequence.original_seq_len, *t.shape[2:])
        seq_dim = 1
    length = t.shape[seq_dim]
    if length == sequence.original_seq_len and length != sequence.padded_seq_len:
        if fill is None:
            raise ValueError(
                f"tensor has the original length {length}; padding it to "
                f"{sequence.padded_seq_len} needs an explicit fill= value"
            )
        t = pad_tensor(t, seq_dim, sequence.padded_seq_len - length, fill)
    elif length != sequence.padded_seq_len:
        raise ValueError(
            f"tensor has length {length} on dim {seq_dim}; expected the original length "
            f"{sequence.original_seq_len} or the padded length {sequence.padded_seq_len}"
        )
    return t.index_select(seq_dim, layout.local_token_global_indices.to(t.device))


def gather_tokens(
    t: Tensor, layout: ShardLayout, cp: CPGroup, *, seq_dim: int = 1, trim: bool = False
) -> Tensor:
    """Every rank's part of a token tensor, in global order (one all-gather over ``cp``).

    See ``ContextParallelSharder.gather_token_tensor`` for the gradient contract.

    Args:
        t: [..., P/W, ...] in this rank's layout.
        layout: the batch's layout.
        cp: the CP group the layout was made for.
        seq_dim: the sequence dimension.
        trim: drop the padding: [..., S, ...], or [B, S, ...] for a packed batch.

    Returns:
        [..., P, ...] (or trimmed as above).
    """
    sequence = layout.sequence
    seq_dim = seq_dim % t.dim()
    if t.shape[seq_dim] != layout.local_seq_len:
        raise ValueError(
            f"tensor has length {t.shape[seq_dim]} on dim {seq_dim}; expected the local "
            f"length {layout.local_seq_len} (= padded {sequence.padded_seq_len} / cp {layout.cp_size})"
        )
    full = all_gather_seq(t, dim=seq_dim, cp=cp)
    full = full.index_select(seq_dim, layout.inverse_indices.to(t.device))
    if not trim:
        return full
    full = full.narrow(seq_dim, 0, sequence.original_seq_len)
    if sequence.input_row_shape is not None:
        if seq_dim != 1 or full.shape[0] != 1:
            raise ValueError(
                "trimming a packed tensor back to rows needs it as [1, T, ...] with seq_dim=1, "
                f"got shape {tuple(full.shape)} and seq_dim={seq_dim}"
            )
        full = full.reshape(*sequence.input_row_shape, *full.shape[2:])
    return full
