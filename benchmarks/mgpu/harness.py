"""The multi-GPU run's harness: per-rank state, rank-0 output, agreed phases, collectives.

Every phase (a parity case, one sequence length, one timing) runs through :func:`phase`, which
catches its exception and makes the ranks agree on the outcome, so a failure is recorded instead
of killing the run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from train_testing.bench import GIB, format_table, free_memory, llama_config, sync, write_json
from train_testing.tiny_hf import parameters_to

from .sizes import Sizes

IGNORE = -100


@dataclass(kw_only=True, slots=True)
class Run:
    """Process-wide state of the run (one per rank).

    Attributes:
        args: parsed command line.
        sizes: problem sizes.
        device: "cuda" or "cpu".
        rank: global rank.
        world: W.
        out: output folder.
        meta: environment recorded in every JSON file.
    """

    args: argparse.Namespace
    sizes: Sizes
    device: str
    rank: int
    world: int
    out: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def dev(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


# ----------------------------------------------------------------------------- output helpers
def emit(run: Run, text: str) -> None:
    """Print on rank 0 only (the library rule against print() does not apply to a script)."""
    if run.rank == 0:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.2e}"
        return f"{v:.4g}"
    return "" if v is None else str(v)


def table(run: Run, title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A fixed-width table of ``rows`` on rank 0."""
    if not rows:
        emit(run, f"\n{title}\n  (no rows)")
        return
    emit(run, "\n".join([f"\n{title}", *format_table(rows, columns, cell=_fmt)]))


def write_section(run: Run, section: str, payload: dict[str, Any]) -> None:
    """Write ``<out>/mgpu_<section>_w<W>.json`` on rank 0 (rewritten as the section progresses)."""
    if run.rank == 0:
        write_json(run.out / f"mgpu_{section}_w{run.world}.json", {"meta": run.meta, **payload})


# ----------------------------------------------------------------------------- collectives
def barrier(run: Run) -> None:
    """A barrier through an all-reduce on the run's device (no device guessing by c10d)."""
    dist.all_reduce(torch.zeros(1, device=run.dev))
    sync(run.device)


def reduce_scalar(run: Run, value: float, op: dist.ReduceOp.RedOpType) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=run.dev)
    dist.all_reduce(t, op=op)
    return float(t.item())


def all_ok(run: Run, ok: bool) -> bool:
    """True when ``ok`` holds on every rank (one MIN all-reduce)."""
    return reduce_scalar(run, 1.0 if ok else 0.0, dist.ReduceOp.MIN) > 0.5


@dataclass(kw_only=True, slots=True)
class Outcome:
    """Result of a phase run on every rank, after the ranks agreed.

    Attributes:
        ok: no rank raised.
        value: this rank's return value (None when this rank raised).
        errors: ``"rank r: message"`` of every rank that raised (the same list on every rank).
        oom: some rank ran out of device memory.
    """

    ok: bool
    value: Any
    errors: list[str]
    oom: bool


def phase(run: Run, name: str, fn: Callable[[], Any]) -> Outcome:
    """Run ``fn`` on every rank, catch its exception, and agree on the outcome.

    The agreement is one MIN all-reduce of a success flag (and an object all-gather of the error
    texts after a failure) on every rank. It covers failures that every rank hits at the same
    point, or that happen where ``fn`` runs no collective. A rank that raises while its peers
    wait inside one of ``fn``'s collectives cannot be rescued: that collective times out after
    ``--timeout-s`` and the run ends (the JSON written so far stays).
    """
    value: Any = None
    err: str | None = None
    oom = False
    try:
        value = fn()
    except Exception as exc:
        oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
        last = traceback.extract_tb(exc.__traceback__)[-1]
        err = (
            f"rank {run.rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            f" ({Path(last.filename).name}:{last.lineno})"
        )
        if run.args.verbose:
            traceback.print_exc()
        value = None
    if err is not None:
        free_memory(
            run.device
        )  # after the except block, which kept the failed frames' tensors alive
    ok = all_ok(run, err is None)
    errors: list[str] = []
    any_oom = reduce_scalar(run, 1.0 if oom else 0.0, dist.ReduceOp.MAX) > 0.5
    if not ok:
        gathered: list[Any] = [None] * run.world
        dist.all_gather_object(gathered, err)
        errors = [e for e in gathered if e]
        emit(run, f"[{name}] failed: " + " | ".join(errors))
    return Outcome(ok=ok, value=value, errors=errors, oom=any_oom)


def all_gather_ints(run: Run, value: int) -> list[int]:
    t = torch.tensor([value], dtype=torch.int64, device=run.dev)
    out = [torch.zeros_like(t) for _ in range(run.world)]
    dist.all_gather(out, t)
    return [int(v) for v in out]


def peak_gib_max(run: Run) -> float | None:
    """Peak allocated device memory since the last reset, maximum over ranks (GiB)."""
    if run.device != "cuda":
        return None
    return reduce_scalar(run, torch.cuda.max_memory_allocated() / GIB, dist.ReduceOp.MAX)


def reset_peak(run: Run) -> float:
    """Reset the peak counter; return the memory allocated now (GiB)."""
    if run.device != "cuda":
        return 0.0
    sync(run.device)
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / GIB


def timed(run: Run, fn: Callable[[], Any], *, warmup: int, iters: int) -> float:
    """Median seconds of one ``fn()`` call (each iteration starts together on every rank and is
    device-synchronised), the maximum of the ranks' medians."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        barrier(run)
        start = time.perf_counter()
        fn()
        sync(run.device)
        times.append(time.perf_counter() - start)
    return reduce_scalar(run, statistics.median(times), dist.ReduceOp.MAX)


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """TF32 off for parity checks (restored afterwards)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def rel_err(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected| / max |expected| in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    if e.numel() == 0:
        return 0.0
    return float((a - e).abs().max()) / (float(e.abs().max()) + 1e-30)


def abs_err(actual: Tensor, expected: Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).abs().max()) if e.numel() else 0.0


def broadcast_module(module: torch.nn.Module) -> None:
    """Make every rank hold rank 0's parameters and buffers (independent of RNG behaviour)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)


def build_llama(run: Run, dims: dict[str, int], max_len: int, dtype: torch.dtype) -> Any:
    """A random-init ``LlamaForCausalLM`` of ``dims`` on the run's device, rank 0's weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(run.dev):
        model = parameters_to(LlamaForCausalLM(llama_config(dims, max_len=max_len)), dtype)
    broadcast_module(model)
    return model
