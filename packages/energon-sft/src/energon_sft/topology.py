"""Map (dp, cp, tp, pp) ranks to loader shards.

One loader per data-parallel replica, owned by the replica's first rank (cp = tp = pp = 0),
which broadcasts each batch to its cp/tp/pp peers. Beyond that: a fixed number of *logical*
shards independent of the dp size. Energon cannot re-shard a saved state, so each logical
shard is its own Energon stream (Energon rank = logical shard, world = number of shards) and dp
replica r runs the shards `[r*k, (r+1)*k)` with k = shards / dp. A job can then resume on any
dp size that divides the shard count: every shard continues its own stream exactly.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["TopologyMapper", "broadcast_batch", "broadcast_next", "logical_shards_for"]

_AXES = ("tp", "cp", "dp", "pp")
#: What a replica's loader yields (an SFTBatch in the recipes); the broadcast keeps its type.
_Batch = TypeVar("_Batch")


def logical_shards_for(dp_rank: int, dp_world_size: int, num_logical_shards: int) -> list[int]:
    """The logical shards dp replica `dp_rank` owns: a contiguous block of shards / dp."""
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_world_size={dp_world_size})")
    if num_logical_shards < 1 or num_logical_shards % dp_world_size:
        divisors = [d for d in range(1, num_logical_shards + 1) if num_logical_shards % d == 0]
        raise ValueError(
            f"num_logical_shards={num_logical_shards} is not divisible by "
            f"dp_world_size={dp_world_size}; this state can resume on dp sizes {divisors}"
        )
    k = num_logical_shards // dp_world_size
    return list(range(dp_rank * k, (dp_rank + 1) * k))


class TopologyMapper:
    """Rank layout of a (dp, cp, tp, pp) job and who loads data for whom.

    Args:
        dp, cp, tp, pp: parallel sizes; world size is their product.
        order: axes from fastest- to slowest-varying rank (Megatron: tp, cp, dp, pp).
        num_logical_shards: loader shards; default dp (no elastic resume).
    """

    def __init__(
        self,
        *,
        dp: int,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        order: Sequence[str] = _AXES,
        num_logical_shards: int | None = None,
    ) -> None:
        sizes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
        for name, size in sizes.items():
            if size < 1:
                raise ValueError(f"{name}={size} must be >= 1")
        if sorted(order) != sorted(_AXES):
            raise ValueError(f"order={list(order)} must be a permutation of {list(_AXES)}")
        self.sizes = sizes
        self.order = tuple(order)
        self.world_size = dp * cp * tp * pp
        self.num_logical_shards = dp if num_logical_shards is None else num_logical_shards
        logical_shards_for(0, dp, self.num_logical_shards)  # validates divisibility

    def coords(self, rank: int) -> dict[str, int]:
        """Per-axis index of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is not in [0, world_size={self.world_size})")
        out = {}
        for axis in self.order:
            out[axis] = rank % self.sizes[axis]
            rank //= self.sizes[axis]
        return out

    def rank_of(self, **coords: int) -> int:
        """Global rank of the given per-axis indices (missing axes are 0)."""
        rank, stride = 0, 1
        for axis in self.order:
            idx = coords.get(axis, 0)
            if not 0 <= idx < self.sizes[axis]:
                raise ValueError(f"{axis}={idx} is not in [0, {self.sizes[axis]})")
            rank += idx * stride
            stride *= self.sizes[axis]
        return rank

    def dp_rank(self, rank: int) -> int:
        """The dp replica of global rank ``rank``."""
        return self.coords(rank)["dp"]

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """All global ranks of dp replica `dp_rank`, the loader owner first."""
        members = [r for r in range(self.world_size) if self.coords(r)["dp"] == dp_rank]
        return sorted(members, key=lambda r: (r != self.loader_owner(dp_rank), r))

    def loader_owner(self, dp_rank: int) -> int:
        """The rank that runs replica `dp_rank`'s loader (cp = tp = pp = 0)."""
        return self.rank_of(dp=dp_rank)

    def is_loader_owner(self, rank: int) -> bool:
        """Whether ``rank`` runs its replica's loader (cp = tp = pp = 0)."""
        c = self.coords(rank)
        return c["cp"] == c["tp"] == c["pp"] == 0

    def peers(self, rank: int) -> list[int]:
        """Ranks that receive this owner's batches (empty for a non-owner)."""
        if not self.is_loader_owner(rank):
            return []
        return [r for r in self.replica_ranks(self.dp_rank(rank)) if r != rank]

    def logical_shards(self, dp_rank: int) -> list[int]:
        """The logical loader shards replica ``dp_rank`` reads."""
        return logical_shards_for(dp_rank, self.sizes["dp"], self.num_logical_shards)

    def identity(self) -> dict[str, Any]:
        """The mesh sizes and axis order (saved with the loader state)."""
        return {"sizes": dict(self.sizes), "order": list(self.order)}

    def placement_hash(self) -> str:
        """sha256 of the layout: sizes, axis order, shard count and every owner's shards."""
        placement = {
            **self.identity(),
            "num_logical_shards": self.num_logical_shards,
            "owners": {
                str(self.loader_owner(d)): self.logical_shards(d) for d in range(self.sizes["dp"])
            },
        }
        return hashlib.sha256(json.dumps(placement, sort_keys=True).encode()).hexdigest()

    def new_replica_group(self) -> dist.ProcessGroup | None:
        """Create every replica's process group and return this rank's, for `broadcast_batch`.

        Collective: all ranks call it.
        """
        import torch.distributed as dist

        mine = None
        for d in range(self.sizes["dp"]):
            ranks = sorted(self.replica_ranks(d))
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks and isinstance(group, dist.ProcessGroup):
                mine = group
        return mine


def broadcast_batch(
    batch: _Batch | None, *, mapper: TopologyMapper, group: dist.ProcessGroup | None
) -> _Batch:
    """Send the owner's batch to its replica peers; every replica rank returns the batch.

    Args:
        batch: the batch on the loader owner; ignored (pass None) on peers.
        mapper: the job's layout.
        group: this rank's replica group from `mapper.new_replica_group()`.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    owner = mapper.loader_owner(mapper.dp_rank(rank))
    box = [batch if rank == owner else None]
    dist.broadcast_object_list(box, src=owner, group=group)
    return cast("_Batch", box[0])


def broadcast_next(
    iterator: Iterator[_Batch] | None, *, mapper: TopologyMapper, group: dist.ProcessGroup | None
) -> _Batch:
    """`next(iterator)` on the replica's loader owner, delivered to every rank of the replica.

    The outcome is agreed before anyone acts: when the owner's loader ends, every rank raises
    StopIteration; when it fails, every rank raises `RuntimeError` naming the owner's error,
    so no peer is left waiting in a collective.

    Args:
        iterator: the owner's batch iterator; None on peers.
        mapper: the job's layout.
        group: this rank's replica group from `mapper.new_replica_group()`.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    owner = mapper.loader_owner(mapper.dp_rank(rank))
    box: list[Any] = [None]
    error: BaseException | None = None
    if rank == owner:
        try:
            if iterator is None:
                raise ValueError(f"rank {rank} owns the replica's loader but has no iterator")
            box[0] = ("ok", next(iterator))
        except StopIteration:
            box[0] = ("stop", None)
        except Exception as exc:
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
            error = exc
    dist.broadcast_object_list(box, src=owner, group=group)
    status, payload = box[0]
    if status == "stop":
        raise StopIteration
    if status == "error":
        raise RuntimeError(f"the loader on rank {owner} failed: {payload}") from error
    return payload
