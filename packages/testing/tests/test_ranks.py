"""The harness's own behaviour: results, failures, crashes and hangs all end the test readably."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from train_testing import RankError, RankPool, run_on_ranks

# The functions below run inside spawned ranks; they stay at module level so they pickle by name.


def _all_reduce_rank_ids(rank: int, world_size: int, scale: float) -> list[float]:
    t = torch.tensor([float(rank), 1.0]) * scale
    dist.all_reduce(t)
    return t.tolist()


def _report_pid_and_env(rank: int, world_size: int) -> tuple[int, str | None, str | None, int]:
    return (
        os.getpid(),
        os.environ.get("OMP_NUM_THREADS"),
        os.environ.get("GLOO_SOCKET_IFNAME"),
        dist.get_world_size(),
    )


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 blocks here, waiting for rank 1


def _exit_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _sigkill_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _sleep_forever_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(10_000)
    dist.barrier()


def test_results_come_back_per_rank(rank_pool) -> None:
    results = rank_pool.run(2, _all_reduce_rank_ids, 2.0)
    assert results == [[2.0, 4.0], [2.0, 4.0]]


def test_ranks_get_the_documented_environment(rank_pool) -> None:
    results = rank_pool.run(2, _report_pid_and_env)
    assert [r[1:] for r in results] == [("1", "lo", 2), ("1", "lo", 2)]
    assert results[0][0] != results[1][0]


def test_pool_reuses_processes_and_recovers_after_failure() -> None:
    with RankPool(2) as pool:
        first = [r[0] for r in pool.run(_report_pid_and_env)]
        second = [r[0] for r in pool.run(_report_pid_and_env)]
        assert first == second, "a healthy pool must keep its processes between runs"
        with pytest.raises(RankError):
            pool.run(_raise_on_rank_one, timeout_s=60)
        assert not pool.alive
        third = [r[0] for r in pool.run(_report_pid_and_env)]
        assert set(third).isdisjoint(first), "a failed pool must restart with fresh processes"


def _failure(fn: Callable[[int, int], None], *, timeout_s: float) -> tuple[RankError, float]:
    """The RankError that running ``fn`` on 2 ranks raises, and the seconds it took to come."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(2, fn, timeout_s=timeout_s)
    return info.value, time.monotonic() - start


def test_exception_on_one_rank_shows_its_traceback_quickly() -> None:
    error, elapsed = _failure(_raise_on_rank_one, timeout_s=60)
    message = str(error)
    assert "failed on ranks [1]" in message
    assert "ValueError: deliberate failure on rank one" in message
    assert "rank 0: blocked" in message, message
    assert [f.kind for f in error.failures] == ["exception", "blocked"]
    # The blocked rank is not waited for until its collective times out (30 s) or the 60 s deadline.
    assert elapsed < 25, f"failure took {elapsed:.1f}s to surface"


def test_crashing_rank_is_reported_with_exit_code() -> None:
    message = str(_failure(_exit_on_rank_one, timeout_s=60)[0])
    assert "rank 1: died" in message and "code 3" in message, message


def test_killed_rank_is_reported_with_signal() -> None:
    assert "code -9" in str(_failure(_sigkill_on_rank_zero, timeout_s=60)[0])


def test_hanging_rank_fails_at_deadline_with_its_stack() -> None:
    error, elapsed = _failure(_sleep_forever_on_rank_zero, timeout_s=4)
    message = str(error)
    assert "did not finish within 4s" in message
    assert "_sleep_forever_on_rank_zero" in message, "the blocked rank's stack should be shown"
    assert elapsed < 30, f"the hang took {elapsed:.1f}s to end"


def test_unpicklable_function_is_rejected_before_spawning() -> None:
    pool = RankPool(2)
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda rank, world_size: None)
    assert not pool.alive


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="world_size"):
        RankPool(0)
    with pytest.raises(ValueError, match="backend"):
        RankPool(2, backend="mpi")
