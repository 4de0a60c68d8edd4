"""Vocabulary shards given as plain local tensors plus their process group (Megatron's layout).

# V vocabulary, Vl local vocabulary columns (or weight rows) on this rank

Megatron-core (and other tensor-parallel code that does not use DTensor) keeps the vocab-parallel
logits ``[S, B, Vl]`` and the output-layer weight ``[Vl, H]`` as plain local tensors; the
tensor-parallel group says which ranks hold the other columns. Megatron splits the (padded)
vocabulary evenly: rank r holds ``[r * Vl, (r + 1) * Vl)`` (``VocabUtility``). Passing
``vocab_group=tp_group`` to any public function of this package reads its input that way;
:class:`VocabSplit` names an explicit offset for any other split. Nothing here imports
megatron-core: a tensor and a ``ProcessGroup`` are enough.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from vocab_parallel._sharding import VocabLayout, VocabShard, _is_dtensor, vocab_shard


@dataclass(kw_only=True, slots=True, frozen=True)
class VocabSplit:
    """Where this rank's plain vocabulary shard sits in the global vocabulary.

    Attributes:
        group: the process group whose ranks together hold the whole vocabulary (Megatron's
            tensor-parallel group, ``parallel_state.get_tensor_model_parallel_group()``).
        vocab_start: global index of this rank's first local column; None (with
            ``vocab_size`` None) means the even split ``rank * Vl``, every rank holding the
            same ``Vl`` columns (Megatron's rule, its padded vocabulary divides evenly).
        vocab_size: the global vocabulary size V (Megatron's padded vocabulary); None means
            ``world_size * Vl`` (the even split).
    """

    group: dist.ProcessGroup
    vocab_start: int | None = None
    vocab_size: int | None = None


VocabGroup = dist.ProcessGroup | VocabSplit


def plain_vocab_shard(
    local: Tensor, vocab_group: VocabGroup, *, vocab_dim: int, name: str
) -> VocabShard:
    """Describe a plain local shard ``local`` held under ``vocab_group``.

    Args:
        local: this rank's columns ([..., Vl] logits, vocab_dim=-1) or rows ([Vl, H] weight,
            vocab_dim=0); a plain tensor, not a DTensor.
        vocab_group: a ``ProcessGroup`` (even split) or a :class:`VocabSplit`.
        vocab_dim: the vocabulary dimension of ``local``.
        name: the argument name, for error messages.

    Raises:
        TypeError: ``local`` is a DTensor, or ``vocab_group`` is neither a group nor a split.
        ValueError: an offset or size that cannot hold this shard, or only one of them given.
    """
    if _is_dtensor(local):
        raise TypeError(
            f"{name} is a DTensor and vocab_group was given too; a DTensor carries its own "
            f"layout: pass either the DTensor alone, or {name}.to_local() with vocab_group"
        )
    split = vocab_group if isinstance(vocab_group, VocabSplit) else None
    group = split.group if split is not None else vocab_group
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"vocab_group must be a torch.distributed ProcessGroup or a vocab_parallel.VocabSplit, "
            f"got {type(vocab_group).__name__}; pass e.g. Megatron's "
            "parallel_state.get_tensor_model_parallel_group()"
        )
    local_vocab = local.shape[vocab_dim]
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    start = split.vocab_start if split is not None else None
    size = split.vocab_size if split is not None else None
    if (start is None) != (size is None):
        raise ValueError(
            f"VocabSplit has vocab_start={start} and vocab_size={size}; give both (an explicit "
            "split) or neither (the even split rank * local size)"
        )
    if start is None or size is None:
        start, size = rank * local_vocab, world * local_vocab
    elif start < 0 or start + local_vocab > size:
        raise ValueError(
            f"{name} holds {local_vocab} vocabulary entries from vocab_start={start}, which does "
            f"not fit a vocabulary of vocab_size={size} (need 0 <= vocab_start and "
            f"vocab_start + {local_vocab} <= vocab_size); fix the VocabSplit of rank {rank}"
        )
    layout = VocabLayout(
        # A one-rank group holds all of V: no collective is needed.
        group=group if world > 1 else None,
        vocab_start=start,
        vocab_size=size,
    )
    return VocabShard(local=local, layout=layout)


def resolve_vocab_shard(
    t: Tensor, vocab_group: VocabGroup | None, *, vocab_dim: int, name: str, expected: str
) -> VocabShard:
    """The vocabulary layout of ``t``.

    From ``vocab_group`` when given, else from ``t`` itself (a DTensor's placements, or a plain
    tensor holding all of V).
    """
    if vocab_group is None:
        return vocab_shard(t, vocab_dim=vocab_dim, name=name, expected=expected)
    return plain_vocab_shard(t, vocab_group, vocab_dim=vocab_dim, name=name)
