"""Run a test function on N real processes joined in a ``torch.distributed`` process group.

The processes are spawned (never forked), rendezvous through a file (no fixed ports), use the
loopback interface and one OpenMP thread each, and join a process group with a short timeout.
A :class:`RankPool` keeps its processes and process group alive between calls, so a test module
pays the spawn and ``import torch`` cost once; after any failure the pool is torn down and the
next call starts a fresh one, so one broken test never poisons the next.

Failures are reported, never hung on: an exception on any rank, a rank that dies (segfault,
``os._exit``, SIGKILL) and a rank that blocks past the deadline all raise :class:`RankError` in
the calling test, with each failing rank's traceback, exit code or live stack dump in the message.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train_testing._rank_process import rank_environment, rank_main

logger = logging.getLogger(__name__)

# After the first rank fails, how long the others get to report their own errors before the
# pool is killed: long enough for a simultaneous assertion, far shorter than a collective timeout.
_FAILURE_GRACE_S = 3.0
_POLL_S = 0.05


@dataclass(kw_only=True, slots=True, frozen=True)
class RankFailure:
    """What went wrong on one rank.

    Attributes:
        rank: the rank that failed.
        kind: "exception" (the function raised), "died" (the process exited without answering)
            or "blocked" (still running at the deadline, or after another rank failed).
        detail: the traceback, exit code or stack dump.
    """

    rank: int
    kind: str
    detail: str


class RankError(AssertionError):
    """Raised in the calling process when a distributed test function failed on some rank.

    Attributes:
        failures: one entry per failing rank, exceptions first.
    """

    def __init__(self, summary: str, failures: list[RankFailure]) -> None:
        self.failures = failures
        sections = [summary]
        for failure in failures:
            sections.append(
                f"--- rank {failure.rank}: {failure.kind} ---\n{failure.detail.rstrip()}"
            )
        super().__init__("\n".join(sections))


class RankPool:
    """A set of spawned ranks that share one process group and run test functions on request.

    Example::

        with RankPool(world_size=2) as pool:
            results = pool.run(check_all_reduce, torch.ones(3))   # one result per rank

    Args:
        world_size: number of ranks (processes).
        backend: "gloo" (CPU) or "nccl" (one GPU per rank).
        pg_timeout_s: timeout of the process group's collectives, so a rank blocked on a dead
            peer raises instead of waiting for PyTorch's 30-minute default.
        start_timeout_s: how long spawning and joining the group may take.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        pg_timeout_s: float = 30.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.world_size = world_size
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self._processes: list[Any] = []
        self._task_queues: list[Any] = []
        self._results: Any = None
        self._workdir: Path | None = None
        self._next_task_id = 0

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """Whether the ranks are running and ready for a task."""
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._workdir = Path(tempfile.mkdtemp(prefix="train-testing-"))
        init_file = self._workdir / "rendezvous"
        self._results = ctx.Queue()
        self._task_queues = [ctx.Queue() for _ in range(self.world_size)]
        with rank_environment():
            for rank in range(self.world_size):
                process = ctx.Process(
                    target=rank_main,
                    args=(
                        rank,
                        self.world_size,
                        self.backend,
                        str(init_file),
                        self.pg_timeout_s,
                        str(self._stack_file(rank)),
                        self._task_queues[rank],
                        self._results,
                    ),
                    name=f"rank{rank}",
                    daemon=True,
                )
                process.start()
                self._processes.append(process)
        self._collect(task_id=-1, timeout_s=self.start_timeout_s, what="joining the process group")

    def _stack_file(self, rank: int) -> Path:
        assert self._workdir is not None
        return self._workdir / f"rank{rank}.stack"

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank and return their results.

        Args:
            fn: a module-level function (it is pickled by reference and re-imported by each rank,
                so keep it in a module that imports quickly).
            *args: positional arguments after ``rank, world_size``; must be picklable.
            timeout_s: deadline for all ranks to finish.
            **kwargs: keyword arguments for ``fn``.

        Returns:
            The return values, indexed by rank.

        Raises:
            RankError: a rank raised, died or did not finish in time. The pool is closed and
                restarts on the next call.
            TypeError: ``fn`` or the arguments cannot be pickled.
        """
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            raise TypeError(
                f"cannot send {fn!r} and its arguments to the ranks ({err}); use a module-level "
                "function and picklable arguments (no lambdas, closures or local functions)"
            ) from err
        if not self.alive:
            self.close()
            self._start()
        self._next_task_id += 1
        task_id = self._next_task_id
        for task_queue in self._task_queues:
            task_queue.put((task_id, list(sys.path), payload))
        name = getattr(fn, "__qualname__", repr(fn))
        outcomes = self._collect(task_id=task_id, timeout_s=timeout_s, what=f"running {name}")
        return [pickle.loads(outcomes[rank]) for rank in range(self.world_size)]

    def _collect(self, *, task_id: int, timeout_s: float, what: str) -> dict[int, Any]:
        """Wait for every rank's answer to ``task_id``; on any failure close the pool and raise."""
        answers: dict[int, Any] = {}
        failures: dict[int, RankFailure] = {}
        deadline = time.monotonic() + timeout_s
        first_failure_at: float | None = None
        while len(answers) + len(failures) < self.world_size:
            now = time.monotonic()
            if now > deadline or (
                first_failure_at is not None and now > first_failure_at + _FAILURE_GRACE_S
            ):
                break
            try:
                answer_id, rank, ok, value = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                for rank, process in enumerate(self._processes):
                    if rank not in answers and rank not in failures and not process.is_alive():
                        # A last answer may still be in flight from a rank that just exited.
                        with contextlib.suppress(queue.Empty):
                            while True:
                                answer_id, r, ok, value = self._results.get(timeout=_POLL_S)
                                self._record(answer_id, task_id, r, ok, value, answers, failures)
                        if rank not in answers and rank not in failures:
                            failures[rank] = RankFailure(
                                rank=rank,
                                kind="died",
                                detail=f"process exited with code {process.exitcode} without "
                                "answering (a crash, os._exit or a signal; negative = signal number)",
                            )
                if failures and first_failure_at is None:
                    first_failure_at = time.monotonic()
                continue
            self._record(answer_id, task_id, rank, ok, value, answers, failures)
            if failures and first_failure_at is None:
                first_failure_at = time.monotonic()
        if not failures and len(answers) == self.world_size:
            return answers
        blocked = [r for r in range(self.world_size) if r not in answers and r not in failures]
        stacks = self._dump_stacks(blocked)
        for rank in blocked:
            failures[rank] = RankFailure(rank=rank, kind="blocked", detail=stacks.get(rank, ""))
        self.close()
        ordered = sorted(failures.values(), key=lambda f: (f.kind != "exception", f.rank))
        if first_failure_at is None:
            summary = (
                f"{what} on {self.world_size} ranks did not finish within {timeout_s:.0f}s; "
                f"ranks {blocked} were still running (stacks below)"
            )
        else:
            failed = sorted(r for r, f in failures.items() if f.kind != "blocked")
            summary = f"{what} failed on ranks {failed} of {self.world_size}"
            if blocked:
                summary += f"; ranks {blocked} were still waiting (likely on the failed ranks)"
        raise RankError(summary, ordered)

    @staticmethod
    def _record(
        answer_id: int,
        task_id: int,
        rank: int,
        ok: bool,
        value: Any,
        answers: dict[int, Any],
        failures: dict[int, RankFailure],
    ) -> None:
        if answer_id != task_id:
            return  # a late answer to an earlier, abandoned task
        if ok:
            answers[rank] = value
        else:
            failures[rank] = RankFailure(rank=rank, kind="exception", detail=value)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask blocked ranks for their Python stacks (faulthandler on SIGUSR1) and read them."""
        for rank in ranks:
            process = self._processes[rank]
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGUSR1)
        if ranks:
            time.sleep(0.5)
        stacks = {}
        for rank in ranks:
            try:
                text = self._stack_file(rank).read_text()
            except OSError:
                text = ""
            stacks[rank] = text.strip() or "(no stack dump received)"
        return stacks

    def close(self) -> None:
        """Stop every rank (politely, then by force) and delete the rendezvous directory."""
        for task_queue, process in zip(self._task_queues, self._processes, strict=True):
            if process.is_alive():
                with contextlib.suppress(Exception):
                    task_queue.put(None)
        deadline = time.monotonic() + 5.0
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        for q in [*self._task_queues, self._results]:
            if q is not None:
                q.close()
                q.cancel_join_thread()
        self._processes, self._task_queues, self._results = [], [], None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    pg_timeout_s: float = 30.0,
    **kwargs: Any,
) -> list[Any]:
    """Spawn ``world_size`` fresh ranks, run ``fn(rank, world_size, *args, **kwargs)``, stop them.

    Prefer the ``rank_pool`` fixture, which reuses processes across tests; use this for tests
    that need fresh processes (for example ones that kill a rank on purpose).

    Returns:
        The return values, indexed by rank.

    Raises:
        RankError: as :meth:`RankPool.run`.
    """
    with RankPool(world_size, backend=backend, pg_timeout_s=pg_timeout_s) as pool:
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
