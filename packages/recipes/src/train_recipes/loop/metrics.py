"""Run output on rank 0: progress bar, metrics JSONL, trackers, start-up timings, loss PNG.

matplotlib is optional (extra ``train-recipes[plot]``): without it the run prints a one-line
notice instead of writing ``loss.png`` (:func:`loss_plot_or_notice`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from train_recipes.config.loader import JSONValue
from train_recipes.loop.trackers import Tracker, finite_scalars, open_trackers

if TYPE_CHECKING:
    from train_recipes.loop.records import RunStart

logger = logging.getLogger(__name__)

__all__ = [
    "LOSS_PLOT",
    "METRICS_FILE",
    "RunLogger",
    "StartupClock",
    "TokenMeter",
    "TokenWindow",
    "loss_plot_or_notice",
    "plot_loss",
    "read_metrics",
]

METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"


class RunLogger:
    """Writes metric records (JSONL + trackers) and drives the progress bar.

    Every method is a no-op on ranks other than 0 (``enabled=False``), so callers need not branch.
    The bar appears at the first :meth:`progress` call, so the lines printed before the first
    step (start-up phases, held-out accuracy) stand on their own, never inside a bar.

    Args:
        start: what the recipe's ``setup()`` reported: the run directory (``output_dir``), the
            bar's length (``plan.total_steps``), label (``desc``) and first step
            (``start_step``, after a resume), and the trackers: TensorBoard event files under
            ``output_dir/tensorboard`` (``tensorboard``; skipped with a one-line notice when
            tensorboard is not installed), "wandb" and/or "mlflow" (``loggers``, see
            ``train_recipes.loop.trackers``) and the config they record (``run_config``).
        enabled: True on rank 0 only.
    """

    def __init__(self, start: RunStart, *, enabled: bool) -> None:
        out_dir, start_step = start.output_dir, start.start_step
        self.enabled = enabled
        self.path = out_dir / METRICS_FILE
        self._trackers: list[Tracker] = []
        self._bar: Any = None
        self._steps_started: float | None = None
        self._bar_args = {
            "total": start.plan.total_steps,
            "initial": start_step,
            "desc": start.desc,
        }
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        # A resumed run drops the records the crashed run wrote after its last checkpoint (and
        # a line torn by a kill in the middle of an append).
        if self.path.is_file():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if (row := _parse(line)) is not None
                and cast(int, row.get("step", -1)) <= start_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._trackers = open_trackers(
            out_dir,
            tensorboard=start.tensorboard,
            loggers=start.loggers,
            run_name=out_dir.name,
            config=start.run_config or {},
            start_step=start_step,
            notice=self.write,
        )

    def log(self, step: int, record: Mapping[str, object]) -> None:
        """Append one record (JSONL), mirror its finite numbers to the trackers."""
        if not self.enabled:
            return
        row = {"step": step, **record}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = finite_scalars(record)
        if scalars:
            for tracker in self._trackers:
                tracker.log(step, scalars)

    def start_steps(self) -> None:
        """Mark the start of this process's first training step: the bar's rate counts from it.

        The bar itself appears at the first logged step.
        """
        self._steps_started = time.time()  # tqdm's clock

    def progress(self, step: int, postfix: Mapping[str, str]) -> None:
        """Move the bar to ``step`` and show ``postfix`` (loss, tokens/s, lr, ...)."""
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(**self._bar_args, dynamic_ncols=True, smoothing=0.1)
            if self._steps_started is not None:
                # Dated from its own creation, the bar's first rate was the steps already done
                # over a few microseconds (323634.57it/s).
                self._bar.start_t = self._bar.last_print_t = self._steps_started
        self._bar.n = step
        self._bar.set_postfix(postfix, refresh=True)

    def write(self, text: str) -> None:
        """Print a line above the bar (rank 0 only)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close_bar(self) -> None:
        """End the bar (lines printed afterwards stand alone); the trackers stay open."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """Close the bar and finish the trackers."""
        self.close_bar()
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


@dataclass(kw_only=True, slots=True, frozen=True)
class TokenWindow:
    """What :meth:`TokenMeter.read` measured since the previous read (global counts).

    Attributes:
        tokens: real input tokens (non-padding) over all replicas.
        flops: their model FLOPs (:mod:`train_recipes.loop.throughput`).
        seconds: the training time they took on this rank.
        loss_tokens: the trained (loss) tokens over all replicas.
    """

    tokens: float
    flops: float
    seconds: float
    loss_tokens: float

    @property
    def tokens_per_s(self) -> float:
        """Global input tokens per second."""
        return self.tokens / max(self.seconds, 1e-9)


class TokenMeter:
    """Input tokens, model FLOPs and loss tokens since the last metric record, and their time.

    Input tokens (and their FLOPs) are counted on the host copy of each micro-batch (a device
    read would stall the GPU's queue); a replica's cp and tp ranks see the same rows, so each
    adds its share and the sum over all ranks at read time is the global count. Loss tokens are
    the Engine's global count of each step (a device tensor, summed without a host sync until
    read). The clock runs from :meth:`restart_clock` (the first step) and stops while
    :meth:`paused` (evaluation, checkpoints): a rate covers the training steps with their data
    loading, host work and the loop between them, nothing else.

    Args:
        duplicates: ranks that see the same rows (cp * tp).
    """

    def __init__(self, *, duplicates: int) -> None:
        self._duplicates = duplicates
        self._inputs = torch.zeros(2, dtype=torch.float64)  # tokens, model FLOPs
        self._loss_tokens: torch.Tensor | None = None
        self._since = time.perf_counter()
        # The run's rate: the first read (compilation, warm-up) and the sum of the later ones.
        self._first: TokenWindow | None = None
        self._later: TokenWindow | None = None

    def restart_clock(self) -> None:
        """Measure the rate from now (the first step of this process)."""
        self._since = time.perf_counter()

    @contextlib.contextmanager
    def paused(self, device: torch.device) -> Iterator[None]:
        """Stop the clock for the block (collective work outside the steps: evaluation, saves).

        The device's queued training work finishes first, so it counts as training.
        """
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._since += time.perf_counter() - start

    def add_inputs(self, attention_mask: torch.Tensor, *, flops: float = 0.0) -> None:
        """Count one micro-batch's real tokens (its host ``attention_mask`` [B, S]) and FLOPs."""
        self._inputs[0] += float(attention_mask.sum()) / self._duplicates
        self._inputs[1] += flops / self._duplicates

    def add_loss_tokens(self, num_tokens: torch.Tensor) -> None:
        """Add one step's global loss-token count (``Engine.global_num_tokens``)."""
        tokens = self._loss_tokens
        self._loss_tokens = num_tokens if tokens is None else tokens + num_tokens

    def read(self, device: torch.device) -> TokenWindow:
        """The counts and the time since the last read; collective."""
        inputs = self._inputs.clone().to(device)
        if dist.is_initialized():
            dist.all_reduce(inputs)
        tokens, flops = inputs.tolist()  # waits for the device: its queued steps count
        now = time.perf_counter()
        loss_tokens = 0.0 if self._loss_tokens is None else float(self._loss_tokens)
        window = TokenWindow(
            tokens=tokens, flops=flops, seconds=now - self._since, loss_tokens=loss_tokens
        )
        self._since = now
        self._inputs.zero_()
        self._loss_tokens = None
        if self._first is None:
            self._first = window
        else:
            self._later = window if self._later is None else _added(self._later, window)
        return window

    def run_window(self) -> TokenWindow | None:
        """The reads after the first, summed; the first alone when there was one; None before any.

        The first read holds the compilation and warm-up of the first step.
        """
        return self._later if self._later is not None else self._first


def _added(a: TokenWindow, b: TokenWindow) -> TokenWindow:
    return TokenWindow(
        tokens=a.tokens + b.tokens,
        flops=a.flops + b.flops,
        seconds=a.seconds + b.seconds,
        loss_tokens=a.loss_tokens + b.loss_tokens,
    )


class StartupClock:
    """Times the start-up phases and prints one line per finished phase (rank 0).

    Args:
        enabled: print (rank 0 only); timings are kept on every rank.
    """

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.phases: dict[str, float] = {}
        self._t0 = time.perf_counter()
        self._open: tuple[str, float] | None = None

    def start(self, name: str) -> None:
        """Begin phase ``name`` (ending the open one)."""
        self.end()
        self._open = (name, time.perf_counter())

    def end(self) -> None:
        """End the open phase and print ``name  seconds``."""
        if self._open is None:
            return
        name, t = self._open
        self._open = None
        self.phases[name] = time.perf_counter() - t
        if self.enabled:
            print(f"{name:<22} {self.phases[name]:6.1f} s", flush=True)

    def summary(self) -> str:
        """``data 0.4 s, model 1.1 s, ...`` of the finished phases."""
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items())


def _parse(line: str) -> dict[str, JSONValue] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def read_metrics(path: str | Path) -> list[dict[str, JSONValue]]:
    """Records of a metrics JSONL file (or of ``<run dir>/metrics.jsonl``)."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p} does not exist; pass a run directory or its {METRICS_FILE}")
    return [row for line in p.read_text().splitlines() if (row := _parse(line)) is not None]


def plot_loss(metrics: str | Path, out_png: str | Path | None = None) -> Path:
    """Draw loss and loss_avg_window against the optimizer step (matplotlib, Agg backend).

    Args:
        metrics: a run directory or its metrics JSONL.
        out_png: the image to write; default ``<run dir>/loss.png``.

    Returns:
        The PNG path.
    """
    try:
        import matplotlib
    except ImportError:
        from train_recipes.config.extras import install_hint

        raise ImportError(
            f"drawing the loss curve needs matplotlib; {install_hint('plot')}"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics) if "loss" in r]
    src = Path(metrics)
    run_dir = src if src.is_dir() else src.parent
    png = Path(out_png) if out_png is not None else run_dir / LOSS_PLOT
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = [cast(int, r["step"]) for r in rows]
    losses = [cast(float, r["loss"]) for r in rows]
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="loss")
    if rows and "loss_avg_window" in rows[0]:
        avg = [cast(float, r["loss_avg_window"]) for r in rows]
        ax.plot(steps, avg, lw=1.8, label="loss_avg_window")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token mean)")
    # A policy-gradient loss (GRPO) is 0 or negative at times: no log scale for it.
    ax.set_yscale("log" if losses and min(losses) > 0 else "linear")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(run_dir.name)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png


def loss_plot_or_notice(run_dir: Path) -> Path | None:
    """:func:`plot_loss` of a run, or None after a one-line notice when matplotlib is missing."""
    try:
        return plot_loss(run_dir)
    except ImportError as err:
        print(f"no {LOSS_PLOT}: {err}", flush=True)
        return None
