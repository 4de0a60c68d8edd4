"""Run output on rank 0: progress bar, metrics JSONL, TensorBoard and the loss-curve PNG."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"


class RunLogger:
    """Writes metric records (JSONL + TensorBoard) and drives the progress bar.

    Every method is a no-op on ranks other than 0 (``enabled=False``), so callers need not branch.

    Args:
        out_dir: the run directory.
        enabled: True on rank 0 only.
        total_steps: optimizer steps of the whole run (for the bar and the ETA).
        start_step: first step of this process (after a resume).
        tensorboard: also write TensorBoard event files under ``out_dir/tensorboard``.
        desc: progress-bar label.
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        desc: str = "sft",
    ) -> None:
        self.enabled = enabled
        self.path = out_dir / METRICS_FILE
        self._tb: Any = None
        self._bar: Any = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        # A resumed run drops the records the crashed run wrote after its last checkpoint (and
        # a line torn by a kill in the middle of an append).
        if self.path.is_file():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if (row := _parse(line)) is not None and row.get("step", -1) <= start_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step + 1)
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True, smoothing=0.1
        )
        self._t0 = time.perf_counter()

    def log(self, step: int, record: dict[str, Any]) -> None:
        """Append one record (JSONL), mirror the numbers to TensorBoard."""
        if not self.enabled:
            return
        row = {"step": step, **record}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        """Move the bar to ``step`` and show ``postfix`` (loss, tokens/s, lr, ...)."""
        if self._bar is None:
            return
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

    def close(self) -> None:
        """Flush TensorBoard and close the bar."""
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _parse(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics) if "loss" in r]
    src = Path(metrics)
    run_dir = src if src.is_dir() else src.parent
    png = Path(out_png) if out_png is not None else run_dir / LOSS_PLOT
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], lw=0.8, alpha=0.5, label="loss")
    if rows and "loss_avg_window" in rows[0]:
        ax.plot(steps, [r["loss_avg_window"] for r in rows], lw=1.8, label="loss_avg_window")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token mean)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(run_dir.name)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png
