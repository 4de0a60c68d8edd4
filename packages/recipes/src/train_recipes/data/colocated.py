"""One loader per data-parallel replica, colocated with the replica's first rank.

energon-sft's ``TopologyMapper`` names the owner of each replica's loader (its rank with
cp = tp = 0). Only the owner builds and reads the loader; its cp/tp peers receive every batch
by broadcast over the replica's process group, so no rank reads data another rank of its
replica already read. The outcome of each ``next()`` (a batch, the end, or the owner's error)
is agreed before anyone acts (energon-sft's ``broadcast_next``), so no peer is left waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from train_recipes.data import energon_api as data_api
from train_recipes.run.process_group import RankContext

if TYPE_CHECKING:
    from energon_sft import SFTBatch, SFTLoader, SFTTaskEncoder
    from train_recipes.config.sft import SFTConfig

__all__ = ["ColocatedLoader", "replica_loader"]

logger = logging.getLogger(__name__)


class ColocatedLoader:
    """The replica's loader on its owner rank; the same batches, by broadcast, on its peers.

    Iterating gives the owner's batches on every rank of the replica; ``state_dict`` and
    ``load_state_dict`` act on the owner's loader (peers hold no loader state: None).

    Args:
        build: builds this replica's energon-sft loader; called on the owner rank only.
        ctx: this rank's place in the (dp, cp, tp) mesh.
        num_logical_shards: the loader's logical shards (None: dp).

    Attributes:
        is_owner: this rank runs the replica's loader.
        loaders_built: loaders this rank built (1 on an owner, 0 on a peer): a test of
            "once per replica" sums it over the ranks.
    """

    def __init__(
        self,
        build: Callable[[], SFTLoader],
        *,
        ctx: RankContext,
        num_logical_shards: int | None = None,
    ) -> None:
        self._mapper = data_api.topology_mapper(
            dp=ctx.dp_size, cp=ctx.cp_size, tp=ctx.tp_size, num_logical_shards=num_logical_shards
        )
        mapped = self._mapper.dp_rank(ctx.rank)
        if mapped != ctx.dp_rank:  # the mesh and energon-sft's layout must order ranks alike
            raise RuntimeError(
                f"rank {ctx.rank}: the mesh puts it in dp replica {ctx.dp_rank}, energon-sft's "
                f"TopologyMapper in {mapped}; both must order ranks tp fastest, then cp, then dp"
            )
        self.is_owner = self._mapper.is_loader_owner(ctx.rank)
        self.replica_size = ctx.cp_size * ctx.tp_size
        # Collective: every rank creates every replica's group, in the same order.
        self._group = self._mapper.new_replica_group() if self.replica_size > 1 else None
        self.loader = build() if self.is_owner else None
        self.loaders_built = 1 if self.is_owner else 0

    def __iter__(self) -> Iterator[SFTBatch]:
        """One pass of the owner's loader, delivered to every rank of the replica."""
        inner = iter(self.loader) if self.loader is not None else None
        if self._group is None:  # a replica of one rank: nothing to broadcast
            assert inner is not None
            yield from inner
            return
        while True:
            try:
                batch = data_api.broadcast_next(inner, mapper=self._mapper, group=self._group)
            except StopIteration:
                return
            yield batch

    def close(self) -> None:
        """Stop the owner's loader (its iterators and worker processes); a peer has none.

        Called when the run ends. A loader still iterating at interpreter exit is torn down
        during finalization, and the rank then ends with nanobind's leak report on stderr
        (triton's bindings, about 60 lines).
        """
        if self.loader is not None:
            self.loader.close()

    def state_dict(self) -> dict[str, object] | None:
        """The owner's loader state; None on a peer."""
        return None if self.loader is None else self.loader.state_dict()

    def load_state_dict(
        self, state: Mapping[str, object] | Sequence[Mapping[str, object] | None] | None
    ) -> None:
        """Restore the owner's loader from its saved state, or from the states of all old ranks.

        A list may hold the None states of the old job's peers; they are left out. A peer
        ignores the state: its batches come from the owner.
        """
        if self.loader is None:
            return
        if isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
            kept: list[Mapping[str, object]] = [s for s in state if s is not None]
            state = kept
        if state is None:
            raise ValueError(
                "the checkpoint holds no loader state for this replica's loader rank; it was "
                "saved by a job without one (resume with the layout that saved it)"
            )
        self.loader.load_state_dict(state)


def replica_loader(
    config: SFTConfig, ctx: RankContext, dataset_path: str | Path, *, encoder: SFTTaskEncoder
) -> ColocatedLoader:
    """The SFT recipe's loader: energon-sft's, for this rank's replica, on its first rank."""
    data = config.data
    return ColocatedLoader(
        lambda: data_api.build_loader(
            dataset_path,
            encoder=encoder,
            batch_size=data.micro_batch_size,
            dp_rank=ctx.dp_rank,
            dp_world_size=ctx.dp_size,
            num_workers=data.num_workers,
            seed=config.train.seed,
            shuffle=data.shuffle,
            num_logical_shards=data.num_logical_shards,
        ),
        ctx=ctx,
        num_logical_shards=data.num_logical_shards,
    )
