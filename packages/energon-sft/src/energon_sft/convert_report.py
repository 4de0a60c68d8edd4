"""What a conversion read, wrote, held out and rejected: the report and the refusal.

`energon_sft.convert` fills a `ConvertReport` while it reads; `problem` says whether the result
is refused (nothing usable, nothing left to train on, too many rejected rows).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from energon_sft.formats import RowFormat

__all__ = ["MAX_EXAMPLES", "BadRowsError", "ConvertReport", "Rejection", "problem"]

#: Rejections kept with their line for the report (the rest are only counted).
MAX_EXAMPLES = 5


@dataclass(kw_only=True, slots=True, frozen=True)
class Rejection:
    """One rejected row: where it is and why."""

    file: str
    line: int
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: [{self.reason}] {self.message}"


@dataclass(kw_only=True, slots=True)
class ConvertReport:
    """What `convert_files` read, wrote and rejected.

    Attributes:
        files: the inputs (JSONL or Parquet files, save_to_disk folders).
        out_dir: the dataset folder (`convert_to_jsonl`: the JSONL file).
        row_format: the input format.
        rows_read: rows read (JSONL: non-blank lines).
        rows_written: rows written to the shards.
        rows_held_out: rows written to the held-out JSONL instead.
        held_out_path: that file (None when no row was held out).
        rejected: rejected rows per reason.
        examples: the first `MAX_EXAMPLES` rejections, with file and line.
        shards: the tar shards written (empty when the conversion failed).
        seconds_rows: time to read, check and write the rows.
        seconds_index: time of `energon prepare`.
    """

    files: list[Path]
    out_dir: Path
    row_format: RowFormat
    rows_read: int = 0
    rows_written: int = 0
    rows_held_out: int = 0
    held_out_path: Path | None = None
    rejected: Counter[str] = field(default_factory=Counter)
    examples: list[Rejection] = field(default_factory=list)
    shards: list[Path] = field(default_factory=list)
    seconds_rows: float = 0.0
    seconds_index: float = 0.0

    @property
    def rows_rejected(self) -> int:
        """Rows refused, all reasons together."""
        return sum(self.rejected.values())

    @property
    def bad_fraction(self) -> float:
        """Refused rows over rows read (0 when none were read)."""
        return self.rows_rejected / self.rows_read if self.rows_read else 0.0

    def reject(self, where: Rejection) -> None:
        """Count a refused row under its reason (the first few are kept as examples)."""
        self.rejected[where.reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(where)

    def summary_lines(self) -> list[str]:
        """Human-readable counts, the first rejections, and (when written) the result."""
        reasons = ", ".join(f"{r} {n}" for r, n in self.rejected.most_common())
        held = f", held out {self.rows_held_out}" if self.held_out_path is not None else ""
        lines = [
            f"rows read {self.rows_read}, written {self.rows_written}{held}, rejected "
            f"{self.rows_rejected}" + (f" ({reasons})" if reasons else "")
        ]
        if self.examples:
            shown = len(self.examples)
            lines.append(f"first {shown} rejected row(s):" if shown > 1 else "rejected row:")
            lines.extend(f"  {ex}" for ex in self.examples)
        if self.shards:
            lines.append(
                f"prepared Energon dataset at {self.out_dir}: {self.rows_written} rows in "
                f"{len(self.shards)} shard(s) ({self.seconds_rows:.1f} s rows, "
                f"{self.seconds_index:.1f} s energon prepare)"
            )
        if self.held_out_path is not None and self.rows_held_out:
            lines.append(f"held-out rows (never trained on) in {self.held_out_path}")
        return lines


class BadRowsError(ValueError):
    """Nothing usable, or more rejected rows than `max_bad_fraction` allows.

    Attributes:
        report: the counts and first rejections (nothing was written).
    """

    def __init__(self, message: str, report: ConvertReport) -> None:
        super().__init__(message)
        self.report = report


def problem(report: ConvertReport, max_bad_fraction: float) -> str | None:
    """Why the conversion is refused (None: it is not), as one line."""
    if report.rows_read == 0:
        return f"no rows in {', '.join(map(str, report.files))}: nothing to convert"
    if report.rows_written == 0 and report.rows_held_out == 0:
        first = f"; the first: {report.examples[0]}" if report.examples else ""
        return f"none of the {report.rows_read} rows is usable{first}"
    if report.rows_written == 0:
        return (
            f"all {report.rows_held_out} usable rows were held out, none is left to train on; "
            "hold out fewer rows"
        )
    if report.bad_fraction > max_bad_fraction:
        return (
            f"{report.rows_rejected} of {report.rows_read} rows rejected "
            f"({100 * report.bad_fraction:.1f}%) > --max-bad-fraction {max_bad_fraction}; "
            f"fix the rows, check --format, or raise --max-bad-fraction "
            f"(e.g. {_ceil_fraction(report.bad_fraction)}) to drop them"
        )
    return None


def _ceil_fraction(x: float) -> str:
    # A value that lets exactly this share through, rounded up to 3 decimals.
    return f"{min(1.0, -(-round(x * 1000, 6) // 1) / 1000):g}"
