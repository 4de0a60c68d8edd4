"""Shared helpers of the engine benchmarks: process group, timing, table and JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def init_single_process_group(device: str) -> None:
    """Join a process group: torchrun's if launched by it, else a 1-rank group of our own."""
    if dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        store = Path(tempfile.mkdtemp(prefix="engine-bench-")) / "store"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], device: str, *, iters: int) -> float:
    """Wall time of ``iters`` calls of ``fn`` in milliseconds per call (device synchronised)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / iters


def environment(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "threads": torch.get_num_threads(),
    }
    return info


def report(
    title: str, rows: list[dict[str, Any]], columns: list[str], out: str | None, meta: dict
) -> None:
    """Print a table of ``rows`` and write ``{meta, rows}`` as JSON to ``out`` (if given)."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {out}")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def median(values: list[float]) -> float:
    return statistics.median(values)
