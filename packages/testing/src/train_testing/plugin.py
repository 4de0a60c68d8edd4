"""pytest plugin (registered through the ``pytest11`` entry point): the ``rank_pool`` fixture."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from train_testing.ranks import RankPool


class RankPools:
    """One :class:`RankPool` per world size, shared by all tests of a session.

    A pool that failed is closed by :class:`RankPool` itself and restarts on its next use.
    """

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def run(
        self, world_size: int, fn: Any, *args: Any, timeout_s: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks."""
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)

    def close(self) -> None:
        """Stop every pool's ranks."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPools]:
    """Session-wide gloo ranks: ``rank_pool.run(world_size, fn, *args)`` returns per-rank results."""
    pools = RankPools()
    yield pools
    pools.close()
