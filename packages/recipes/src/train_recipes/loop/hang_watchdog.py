"""The hang watchdog: names the ranks that stopped running or fell behind.

torch.distributed fixes a process group's timeout at creation (changing it later needs private
API, and re-creating groups would invalidate the DDP/FSDP2 wrappers built on them), and a
timed-out collective names no culprit. So the recipe keeps the group's timeout as a backstop
and runs :class:`HangWatchdog`: a thread per rank that publishes the rank's current step and
the time in the process group's store (one small write per rank per interval). Only a rank
that has waited in its step longer than the limit reads the others' entries (one
``multi_get``); if another rank is still at an earlier step, or has not written for longer than
the limit (a frozen process, e.g. under SIGSTOP), it ends the run with one line naming those
ranks, and leaves that verdict in the store (:func:`hang_report`) for the process hosting it:
the Ray driver names those ranks, not the waiting rank the watchdog ended. Timestamps are
wall-clock, compared across hosts: clock skew must stay well below the limit (NTP keeps it far
below the 30 s floor). The limit is ``train.collective_timeout_s`` until the warm-up steps are
measured, then
``min(collective_timeout_s, max(MIN_STEP_LIMIT_S, STEP_LIMIT_FACTOR * slowest warm-up step))``.
Phases that every rank runs together (evaluation, checkpoints) never trigger it: all ranks are
at the same step and alive.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = [
    "HANG_EXIT_CODE",
    "HangWatchdog",
    "default_store",
    "hang_report",
]

#: Exit status of a rank that the watchdog ends.
HANG_EXIT_CODE = 3
# Where the watchdog's keys live in the rendezvous store.
_KEYS = "train_recipes/watchdog"
#: Steps measured before the step limit tightens (the first step compiles and warms caches and
#: is not measured).
WARMUP_STEPS = 3
#: The tightened limit is this multiple of the slowest warm-up step ...
STEP_LIMIT_FACTOR = 20.0
#: ... and never below this: loader hiccups, garbage collection and rank-0 logging take seconds.
MIN_STEP_LIMIT_S = 30.0


def _abort_process(message: str) -> None:
    from tqdm.auto import tqdm

    # tqdm.write clears a progress bar on the same stream first, so the line stands alone.
    tqdm.write(f"train-recipes: {message}", file=sys.stderr)
    sys.stderr.flush()
    # The main thread is blocked inside a collective that only the group timeout would end;
    # exiting is the only way out (the launcher then stops the other ranks).
    os._exit(HANG_EXIT_CODE)


def default_store() -> dist.Store | None:
    """The store the default process group rendezvoused on, or None when it cannot be reached.

    The root store, not the group's prefixed view of it: the process that hosts it (torchrun's
    agent, the Ray driver) reads the watchdog's verdict there (:func:`hang_report`) after the
    ranks are gone.
    """
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None or not dist.is_initialized():
        return None
    store = get()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def hang_report(store: dist.Store, *, world_size: int) -> str | None:
    """The watchdog's verdict in the newest run of ``store``: the first firing rank's message.

    Args:
        store: the ranks' rendezvous store (:func:`default_store`), e.g. hosted by the driver.
        world_size: ranks in the job.

    Returns:
        The one-line message naming the ranks that stopped or fell behind, or None when no
        rank's watchdog fired.
    """
    arrivals = int(store.add(f"{_KEYS}/arrivals", 0))
    if arrivals == 0:
        return None
    key = f"{_KEYS}/{(arrivals - 1) // world_size}/report"
    if not store.check([key]):
        return None
    return str(store.get(key).decode().partition("|")[2]) or None


class HangWatchdog:
    """Names the ranks that do not reach a step the others wait in (see the module docstring).

    Construct and :meth:`start` it on every rank of a run (runs sharing a store get their own
    keys).

    Args:
        store: the process group's store (``default_store()``); shared by all ranks.
        rank: this rank.
        world_size: ranks in the job.
        timeout_s: the limit before the step time is measured, and the cap after.
        on_hang: called once with the one-line message, after the store got the first firing
            rank's (:func:`hang_report`); the default prints it (from that rank) and ends the
            process with :data:`HANG_EXIT_CODE`.
        interval_s: seconds between heartbeats; default a tenth of the limit (0.2 .. 5 s).
        min_step_limit_s: floor of the tightened limit.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        on_hang: Callable[[str], None] | None = None,
        interval_s: float | None = None,
        min_step_limit_s: float = MIN_STEP_LIMIT_S,
    ) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.limit_s = timeout_s
        self._min_step_limit_s = min_step_limit_s
        self._interval = interval_s
        self._on_hang = on_hang
        # Every rank counts itself in; runs of one group are sequential, so the ranks of one run
        # draw the same generation and a later run never reads an earlier one's keys.
        generation = (int(store.add(f"{_KEYS}/arrivals", 1)) - 1) // world_size
        self._store = dist.PrefixStore(f"{_KEYS}/{generation}", store)
        self._step = 0
        self._entered = time.monotonic()
        self._step_times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self.fired: str | None = None

    def start(self) -> HangWatchdog:
        """Start the heartbeat thread (a no-op for one rank)."""
        if self.world_size > 1:
            self._publish()
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (call before phases where ranks legitimately part ways)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def enter_step(self, step: int) -> None:
        """Called by the main thread at the start of each optimizer step (cheap: no I/O)."""
        now = time.monotonic()
        if self._step > 1 and len(self._step_times) < WARMUP_STEPS:
            self._step_times.append(now - self._entered)
            if len(self._step_times) == WARMUP_STEPS:
                measured = STEP_LIMIT_FACTOR * max(self._step_times)
                self.limit_s = min(self.timeout_s, max(self._min_step_limit_s, measured))
        self._step, self._entered = step, now

    # ------------------------------------------------------------------------ the thread

    def _publish(self) -> None:
        # Wall-clock time: other hosts compare it with theirs (NTP skew is far below the limit).
        self._store.set(str(self.rank), f"{self._step},{time.time():.3f}")

    def _others(self) -> dict[int, tuple[int, float]]:
        """(published step, publication time) of every other rank.

        One store request when every rank has published (the usual case), else one per rank.
        """
        ranks = [r for r in range(self.world_size) if r != self.rank]
        keys = [str(r) for r in ranks]
        if self._store.check(keys):
            values = [v.decode() for v in self._store.multi_get(keys)]
        else:
            values = [
                self._store.get(k).decode() if self._store.check([k]) else "0,0" for k in keys
            ]
        out = {}
        for rank, value in zip(ranks, values, strict=True):
            step, stamp = value.split(",")
            out[rank] = (int(step), float(stamp))
        return out

    def _run(self) -> None:
        while not self._stop.wait(self._interval or min(5.0, max(0.2, self.limit_s / 10))):
            try:
                self._publish()
                message = self._check()
            except Exception as err:  # a store that went away: the run is ending anyway
                logger.debug("hang watchdog stopped: %s", err)
                return
            if message is not None:
                self.fired = message
                self._report(message, first=self._claim(message))
                return

    def _check(self) -> str | None:
        step, waited = self._step, time.monotonic() - self._entered
        if waited <= self.limit_s:
            return None  # not waiting for anybody: no need to read the others' keys
        now = time.time()
        behind, frozen = [], []
        for other, (other_step, stamp) in self._others().items():
            if other_step < step:
                behind.append((other, other_step))
            elif now - stamp > self.limit_s:
                frozen.append(other)
        if not (behind or frozen):
            return None
        parts = []
        if behind:
            names = ", ".join(f"rank {r} (last seen at step {s})" for r, s in behind)
            parts.append(f"{names} did not reach step {step}")
        if frozen:
            names = ", ".join(f"rank {r}" for r in frozen)
            parts.append(f"{names} stopped responding (no heartbeat for {self.limit_s:.0f} s)")
        return (
            f"{'; '.join(parts)}; rank {self.rank} waited {waited:.0f} s at step {step} "
            f"(limit {self.limit_s:.0f} s, train.collective_timeout_s={self.timeout_s:g}). "
            "Look at those ranks' hosts (stopped or swapping process, stalled data loader, "
            "failing device)"
        )

    def _claim(self, message: str) -> bool:
        """Write the verdict unless another rank's came first (:func:`hang_report` reads it)."""
        mine = f"{self.rank}|{message}"
        try:
            return bool(self._store.compare_set("report", "", mine).decode() == mine)
        except Exception:  # pragma: no cover - store gone; print rather than stay silent
            return True

    def _report(self, message: str, *, first: bool) -> None:
        if self._on_hang is not None:
            self._on_hang(message)
            return
        if first:  # one rank prints: the first to claim the report key
            _abort_process(message)
        os._exit(HANG_EXIT_CODE)
