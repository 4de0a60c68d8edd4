"""Progress of a conversion, for command lines: a tqdm bar on a terminal, else periodic lines.

Used by `energon-sft convert` and by callers that convert on a user's behalf (train-recipes'
direct inputs), so both show the same bar and lines on stderr.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["ConvertProgress"]


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class ConvertProgress:
    """Rows read so far: a tqdm bar, or a line on stderr every `every_s` seconds.

    Pass the instance as `convert_files(progress=...)` and its `indexing` as `on_prepare`.

    Args:
        total: rows expected (`energon_sft.sources.count_rows`).
        bar: draw a tqdm bar (on a terminal); else print plain lines.
        every_s: seconds between plain lines.
        label: the lines' prefix.
    """

    def __init__(
        self, total: int, *, bar: bool, every_s: float = 10.0, label: str = "convert"
    ) -> None:
        self.total = total
        self.done = 0
        self.every_s = every_s
        self.label = label
        self._last = time.monotonic()
        self._bar: Any = None
        if bar:
            try:  # tqdm comes with megatron-energon; without it the plain lines are used
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, unit="row", desc=label, dynamic_ncols=True)

    def __call__(self, n: int) -> None:
        """Count `n` more rows read."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            pct = 100 * self.done / self.total if self.total else 100.0
            _err(f"{self.label}: {self.done}/{self.total} rows read ({pct:.0f}%)")

    def indexing(self, n_shards: int) -> None:
        """The rows are written; `energon prepare` indexes `n_shards` shards."""
        self.close()
        _err(f"{self.label}: indexing {n_shards} shard(s) with energon prepare")

    def close(self) -> None:
        """Close the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
