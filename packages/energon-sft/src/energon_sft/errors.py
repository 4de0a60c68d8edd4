"""Bad-sample accounting: a typed error, a counting handler, and the counters batches carry.

Energon calls `WorkerConfig.global_error_handler(exc, sample, sources)` for every exception a
cooker, encoder or batcher raises, then counts *consecutive* failures against a per-stage
tolerance (0 would mean "no limit"). This module adds what SFT needs on top: a log line that
names the sample, per-reason counters, and a total budget per worker that turns into one clear
fatal error instead of an endless stream of skips.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from megatron.energon.errors import FatalSampleError

logger = logging.getLogger(__name__)

__all__ = [
    "BadSampleError",
    "OverlongSampleError",
    "SampleErrorHandler",
    "TooManyBadSamplesError",
    "sample_key",
]


class BadSampleError(ValueError):
    """A sample that cannot be trained on; the loader skips it and counts it under `reason`.

    Args:
        reason: short machine-readable category (`missing_field`, `unknown_role`, ...).
        message: what was wrong, for the log line.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"[{reason}] {message}")
        self.reason = reason


class TooManyBadSamplesError(RuntimeError):
    """More bad samples than `failure_tolerance` allows in one loader worker."""


class OverlongSampleError(FatalSampleError):
    """A row longer than `max_length` under `overlong="error"`: the loader stops.

    A `FatalSampleError`, so Energon's error handling passes it on instead of skipping.
    """


def sample_key(sample: Any) -> str:
    """The Energon `__key__` of a crude dict or a cooked sample, or '?' when there is none."""
    if isinstance(sample, Mapping):
        key = sample.get("__key__")
    else:
        key = getattr(sample, "__key__", None)
    return "?" if key is None else str(key)


def _sources_str(sources: Any) -> str:
    if not sources:
        return ""
    parts = []
    for src in sources:
        shard = getattr(src, "shard_name", None)
        index = getattr(src, "index", None)
        parts.append(f"{shard}#{index}" if shard is not None else str(src))
    return " from " + ", ".join(parts)


class SampleErrorHandler:
    """Energon `global_error_handler`: log the sample, count it, stop above the budget.

    One instance lives in the task encoder; with worker processes every worker gets its own
    copy (fork), so the budget and the counters are per worker. The counters also track rows
    that were kept but changed (`truncated`, `no_trainable_tokens`); those never count against
    the budget.

    Args:
        failure_tolerance: how many samples one worker may skip; the next one raises
            `TooManyBadSamplesError`. Must be >= 1 (Energon reads 0 as "no limit").
    """

    def __init__(self, failure_tolerance: int) -> None:
        if failure_tolerance < 1:
            raise ValueError(
                f"failure_tolerance={failure_tolerance} must be >= 1: Energon reads 0 as "
                "'tolerate every failure', which hides a broken dataset; pass a positive budget"
            )
        self.failure_tolerance = failure_tolerance
        self.counts: Counter[str] = Counter()
        self.skipped = 0

    def __call__(self, exc: Exception, sample: Any, sources: Any = None) -> None:
        """Energon's error handler: count and log the bad sample, abort past the tolerance."""
        reason = exc.reason if isinstance(exc, BadSampleError) else type(exc).__name__
        key = sample_key(sample)
        self.skipped += 1
        self.counts[f"skipped/{reason}"] += 1
        logger.warning(
            "energon-sft: skipping sample %s%s (%d/%d skipped in this worker): %s",
            key,
            _sources_str(sources),
            self.skipped,
            self.failure_tolerance,
            exc,
        )
        if self.skipped > self.failure_tolerance:
            raise TooManyBadSamplesError(
                f"{self.skipped} bad samples in one loader worker exceed failure_tolerance="
                f"{self.failure_tolerance}; the last was {key}{_sources_str(sources)}: {exc}. "
                f"Counts so far: {dict(self.counts)}. Fix the dataset or raise failure_tolerance."
            ) from exc

    def note(self, what: str, sample: Any, detail: str) -> None:
        """Count a row that was altered (truncated, fully masked) or dropped by policy.

        Only the first of each kind is logged: a dataset of over-long rows gives one line per
        worker, not one per row (the counts are in `snapshot()`).
        """
        self.counts[what] += 1
        if self.counts[what] == 1:
            logger.warning(
                "energon-sft: sample %s %s: %s (later rows of this kind are counted, not "
                "logged: SFTLoader.data_stats()['%s'])",
                sample_key(sample),
                what,
                detail,
                what,
            )

    def snapshot(self) -> dict[str, int]:
        """Cumulative counters of this worker: `skipped/<reason>`, `truncated`, ..."""
        return dict(self.counts)
