"""Find where the vocabulary lives: plain tensors, or DTensors sharded on the vocabulary dim."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(kw_only=True, slots=True, frozen=True)
class VocabLayout:
    """Where this rank's vocabulary entries sit in the global vocabulary.

    Attributes:
        group: process group of the mesh dimension that shards the vocabulary; None when
            this rank holds the whole vocabulary (a plain tensor or an all-Replicate DTensor).
        vocab_start: global index of the first local vocabulary entry.
        vocab_size: global vocabulary size V.
    """

    group: dist.ProcessGroup | None
    vocab_start: int
    vocab_size: int


@dataclass(kw_only=True, slots=True, frozen=True)
class VocabShard:
    """The local piece of a tensor with a vocabulary dimension.

    Attributes:
        local: the local tensor (``to_local()`` of a DTensor, differentiable).
        layout: where its vocabulary entries sit in the global vocabulary.
    """

    local: Tensor
    layout: VocabLayout


def _is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def vocab_shard(t: Tensor, *, vocab_dim: int, name: str, expected: str) -> VocabShard:
    """Split ``t`` into its local part and the vocabulary layout.

    Args:
        t: a plain tensor or a DTensor.
        vocab_dim: the vocabulary dimension (negative allowed).
        name: the argument name, for error messages.
        expected: the supported placement, for error messages (e.g. "Shard(-1)").

    Raises:
        ValueError: a Partial placement, a shard of a non-vocabulary dimension, or the
            vocabulary sharded over more than one mesh dimension.
    """
    if not _is_dtensor(t):
        whole = VocabLayout(group=None, vocab_start=0, vocab_size=t.shape[vocab_dim])
        return VocabShard(local=t, layout=whole)

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dim = vocab_dim % t.ndim
    mesh = t.device_mesh  # type: ignore[attr-defined]
    placements = tuple(t.placements)  # type: ignore[attr-defined]
    vocab_mesh_dims: list[int] = []
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is Shard and placement.dim % t.ndim == dim:
            vocab_mesh_dims.append(mesh_dim)
            continue
        raise ValueError(
            f"{name} is a DTensor with placements {placements} on mesh {mesh}; mesh dim "
            f"{mesh_dim} has {placement}, but only {expected} (the vocabulary dim {dim}) or "
            f"Replicate() are supported; redistribute it first, e.g. "
            f"{name}.redistribute(placements=[{expected} or Replicate() per mesh dim])"
        )
    if len(vocab_mesh_dims) > 1:
        raise ValueError(
            f"{name} shards the vocabulary dim {dim} over mesh dims {vocab_mesh_dims} "
            f"(placements {placements}); shard it over one mesh dim and replicate the others"
        )
    local = t.to_local()  # type: ignore[attr-defined]
    if not vocab_mesh_dims:
        whole = VocabLayout(group=None, vocab_start=0, vocab_size=t.shape[dim])
        return VocabShard(local=local, layout=whole)
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    layout = VocabLayout(
        group=mesh.get_group(vocab_mesh_dims[0]),
        vocab_start=int(offset[dim]),
        vocab_size=t.shape[dim],
    )
    return VocabShard(local=local, layout=layout)


def replicated_local(t: Tensor, *, name: str) -> Tensor:
    """The local tensor of an all-Replicate DTensor, or ``t`` itself when it is plain.

    Raises:
        ValueError: a DTensor with any non-Replicate placement.
    """
    if not _is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    placements = tuple(t.placements)  # type: ignore[attr-defined]
    if not all(isinstance(p, Replicate) for p in placements):
        raise ValueError(
            f"{name} is a DTensor with placements {placements}; it must be Replicate() on "
            f"every mesh dim (every vocabulary rank needs all of its tokens); pass "
            f"{name}.redistribute(placements=[Replicate()] * mesh.ndim) or a plain tensor"
        )
    return t.to_local()  # type: ignore[attr-defined]


def check_labels(labels: Tensor, *, batch_shape: torch.Size, what: str) -> Tensor:
    """Validate labels' shape and dtype and return them as int64 [...].

    Raises:
        ValueError: shape mismatch. TypeError: a non-integer dtype.
    """
    if labels.shape != batch_shape:
        raise ValueError(
            f"labels have shape {tuple(labels.shape)} but {what} need shape "
            f"{tuple(batch_shape)} (one label per token); reshape the labels or the inputs"
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(
            f"labels have dtype {labels.dtype}; expected an integer dtype (torch.int64), "
            "cast with labels.long()"
        )
    return labels.long()
