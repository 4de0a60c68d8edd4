"""Loader throughput and resume latency measurements (used by the CLI and bench/)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["measure_throughput", "measure_time_to_first_batch"]


def measure_throughput(
    batches: Iterable[Any], *, n_batches: int, warmup: int = 2, count: Callable[[Any], int]
) -> dict[str, float]:
    """Samples/s and batches/s over `n_batches` after `warmup` batches (startup excluded).

    Args:
        batches: any iterable of batches (Energon loader, torch DataLoader, ...).
        n_batches: timed batches.
        warmup: untimed batches first (worker start, buffer fill).
        count: samples in one batch.
    """
    it = iter(batches)
    t_start = time.perf_counter()
    for _ in range(warmup):
        next(it)
    t_first = time.perf_counter() - t_start
    samples = 0
    t0 = time.perf_counter()
    for _ in range(n_batches):
        samples += count(next(it))
    dt = time.perf_counter() - t0
    return {
        "samples_per_s": samples / dt,
        "batches_per_s": n_batches / dt,
        "startup_s": t_first,
        "timed_s": dt,
        "samples": float(samples),
    }


def measure_time_to_first_batch(restore: Callable[[], Any], *, n_batches: int = 1) -> float:
    """Seconds from calling `restore()` (which returns a restored loader) to `n_batches` batches."""
    t0 = time.perf_counter()
    loader = restore()
    it = iter(loader)
    for _ in range(n_batches):
        next(it)
    return time.perf_counter() - t0
