"""Rank functions for test_train_loop.py (a light module: spawned ranks re-import it)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from _recipes_workers import metric_rows


def _run(overrides: list[str], world_size: int, resume: bool = False) -> Any:
    from train_recipes.config import SFTConfig, load_config, validate_sft
    from train_recipes.sft.run import run_sft

    config = load_config(SFTConfig, None, overrides)
    validate_sft(config, world_size=world_size)
    return config, run_sft(config, resume=resume)


def run_sft_summary(rank: int, world_size: int, overrides: list[str]) -> dict[str, Any]:
    """Run the recipe; rank 0 returns summary.json."""
    config, _ = _run(overrides, world_size)
    if rank != 0:
        return {}
    return dict(json.loads((Path(config.train.output_dir) / "summary.json").read_text()))


def eval_loss_run(rank: int, world_size: int, overrides: list[str]) -> dict[str, Any]:
    """Run the recipe; rank 0 returns the metric rows, the summary and the trained model."""
    config, result = _run(overrides, world_size)
    if rank != 0:
        return {}
    out = Path(config.train.output_dir)
    rows = metric_rows(out)
    summary = json.loads((out / "summary.json").read_text())
    return {"rows": rows, "summary": summary, "model": result.model.cpu()}


def run_sft_expecting_error(
    rank: int, world_size: int, overrides: list[str], resume: bool = False
) -> str:
    """Run the recipe (``resume``: from its folder), which must fail: ``ExceptionType: message``."""
    try:
        _run(overrides, world_size, resume)
    except Exception as err:  # the test asserts which one
        return f"{type(err).__name__}: {err}"
    raise AssertionError("the run did not fail")


def _tcp_store(rank: int, world_size: int) -> Any:
    """A TCPStore served from rank 0, like the one torchrun's agent serves.

    The pool's default store is a FileStore, which holds a file lock for each request: a rank
    SIGSTOPped inside its heartbeat write would block every other rank's store calls, so the
    watchdog under test would never get to read the frozen heartbeat.
    """
    port = [0]
    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        port = [store.port]
    dist.broadcast_object_list(port, src=0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port[0], world_size, is_master=False)
    return store


def _watchdog(rank: int, world_size: int, timeout_s: float, min_step_limit_s: float) -> Any:
    from train_recipes.loop.hang_watchdog import HangWatchdog

    fired: list[tuple[float, str]] = []
    dog = HangWatchdog(
        _tcp_store(rank, world_size),
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        on_hang=lambda message: fired.append((time.monotonic(), message)),
        interval_s=0.1,
        min_step_limit_s=min_step_limit_s,
    ).start()
    for step in range(1, 5):  # warm-up: 3 measured steps, then the limit tightens
        dog.enter_step(step)
        dist.barrier()
    return dog, fired


def watchdog_names_a_sleeping_rank(rank: int, world_size: int, timeout_s: float) -> dict[str, Any]:
    """Rank 1 sleeps 2 x timeout before step 5; rank 0 waits in the step's barrier. The warm-up
    steps take milliseconds, so the limit tightens to its floor, timeout_s / 3."""
    dog, fired = _watchdog(rank, world_size, timeout_s, timeout_s / 3)
    if rank == 1:
        time.sleep(2 * timeout_s)
    dog.enter_step(5)
    entered = time.monotonic()
    dist.barrier()
    dog.stop()
    dist.barrier()  # rank 0 serves the store: it stays up until every watchdog has stopped
    if rank != 0:
        return {}
    return {
        "message": fired[0][1] if fired else None,
        "after_s": fired[0][0] - entered if fired else None,
        "limit_s": dog.limit_s,
    }


def watchdog_names_a_stopped_rank(rank: int, world_size: int, timeout_s: float) -> dict[str, Any]:
    """Rank 0 SIGSTOPs rank 1 inside step 5, waits for its watchdog, then SIGCONTs rank 1."""
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    dog, fired = _watchdog(rank, world_size, timeout_s, timeout_s)
    dog.enter_step(5)
    dist.barrier()  # both are inside step 5
    result: dict[str, Any] = {}
    if rank == 0:
        time.sleep(0.3)  # rank 1 publishes step 5 once more
        os.kill(int(pids[1] or 0), signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            deadline = stopped + 4 * timeout_s
            while not fired and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            os.kill(int(pids[1] or 0), signal.SIGCONT)
        result = {
            "message": fired[0][1] if fired else None,
            "after_s": fired[0][0] - stopped if fired else None,
        }
    dist.barrier()
    dog.stop()
    dist.barrier()  # rank 0 serves the store: it stays up until every watchdog has stopped
    return result
