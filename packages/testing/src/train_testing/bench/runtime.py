"""The process side of a benchmark: process group, device synchronisation, timing, memory."""

from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GIB = 2**30


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device``: where the benchmark runs; CUDA when this machine has it, else the CPU."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def init_process_group(device: str | torch.device, *, timeout_s: float | None = None) -> None:
    """Join torchrun's process group when launched by it, else make a 1-rank group of our own.

    NCCL on CUDA (each rank on the GPU of its ``LOCAL_RANK``), gloo otherwise. The 1-rank group
    rendezvouses through a file in a fresh temporary folder (no port). Nothing happens when a
    group exists already.

    Args:
        device: "cuda", "cuda:<index>" or "cpu".
        timeout_s: collective timeout; None keeps torch's default.
    """
    if dist.is_initialized():
        return
    device = torch.device(device)
    cuda = device.type == "cuda"
    backend = "nccl" if cuda else "gloo"
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        if cuda:
            local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(local)
            dist.init_process_group(backend, timeout=timeout, device_id=local)
        else:
            dist.init_process_group(backend, timeout=timeout)
        return
    folder = tempfile.mkdtemp(prefix="bench-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    store = Path(folder) / "store"
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout
    )
    if cuda:
        torch.cuda.set_device(device.index if device.index is not None else 0)


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device.index)


def free_memory(device: str | torch.device) -> None:
    """Release what the previous variant left (its model, optimizer) before the next is built."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def peak_gib(device: str | torch.device) -> float | None:
    """Peak allocated device memory since the last reset in GiB; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device.index) / GIB


def time_ms(fn: Callable[[], Any], device: str | torch.device, *, iters: int) -> float:
    """Milliseconds per call of ``iters`` back-to-back calls (synchronised before and after)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / iters


def times_ms(
    fn: Callable[[], Any], device: str | torch.device, *, warmup: int, iters: int
) -> list[float]:
    """Milliseconds of each of ``iters`` calls after ``warmup`` calls, each one synchronised."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def event_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call on the current CUDA stream, between two CUDA events.

    The host waits for the second event only; nothing else is synchronised.
    """
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def event_median_ms(fn: Callable[[], Any], *, warmup: int = 3, repeats: int = 20) -> float:
    """Median milliseconds of ``repeats`` back-to-back calls after ``warmup`` (CUDA events).

    Each call sits between two events on the current stream; the host waits once, after the
    last call, so the calls queue without host gaps between them.
    """
    for _ in range(warmup):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats)
    ]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events)


def alternating_medians(
    variants: Mapping[str, Callable[[], Any]],
    *,
    repeats: int,
    measure: Callable[[Callable[[], Any]], float],
) -> dict[str, float]:
    """Median of ``measure(fn)`` per variant, the variants taking turns ``repeats`` times.

    Each variant runs once first (allocator, kernels). Taking turns spreads machine noise over
    every variant alike, so their ratios stay meaningful on a busy machine.
    """
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(measure(fn))
    return {name: statistics.median(t) for name, t in times.items()}
