"""Chat JSONL -> a prepared Energon dataset, keeping only rows the loader can train on.

Every row is mapped to the canonical `messages` row (`energon_sft.formats`), its media files are
read, and the result is cooked by the loader's own cooker (`cook_chat`) on the same crude sample
the loader will see: a row that passes here passes the loader's schema checks, and a rejected row
is reported with its file, line and reason instead of surfacing, counted, at training time. What
needs the tokenizer (template rendering, over-long rows) is checked by `energon-sft inspect`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from energon_sft.cookers import cook_chat, cook_sharegpt
from energon_sft.dataset import ShardWriter, prepare_dataset, resolve_media
from energon_sft.errors import BadSampleError
from energon_sft.formats import FORMATS, RowFormat, alpaca_messages, check_format, media_key
from energon_sft.schema import ChatSample, image_order

logger = logging.getLogger(__name__)

__all__ = [
    "BadRowsError",
    "CheckedRow",
    "ConvertReport",
    "Rejection",
    "RowChecker",
    "convert_files",
    "count_lines",
    "iter_checked_rows",
]

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
        files: the JSONL inputs.
        out_dir: the dataset folder.
        row_format: the input format.
        rows_read: non-blank lines read.
        rows_written: rows written to the shards.
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
        lines = [
            f"rows read {self.rows_read}, written {self.rows_written}, rejected "
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
        return lines


class BadRowsError(ValueError):
    """Nothing usable, or more rejected rows than `max_bad_fraction` allows.

    Attributes:
        report: the counts and first rejections (nothing was written).
    """

    def __init__(self, message: str, report: ConvertReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckedRow:
    """A row that passed: the canonical row to write, its media members, the cooked sample."""

    row: dict[str, Any]
    members: list[tuple[str, bytes]]
    sample: ChatSample


class RowChecker:
    """Map one input row to the canonical row and cook it with the loader's cooker.

    Args:
        row_format: "messages", "sharegpt" or "alpaca".
        media_root: base folder of relative media paths (None: absolute paths only).
        check_images: also decode every image the conversation shows (what the encoder does
            first); slower, catches corrupt files.
    """

    def __init__(
        self, *, row_format: RowFormat, media_root: Path | None, check_images: bool = False
    ) -> None:
        if row_format not in FORMATS:
            raise ValueError(f"row_format={row_format!r}; expected one of {list(FORMATS)}")
        self.row_format: RowFormat = row_format
        self.media_root = media_root
        self.check_images = check_images

    def __call__(self, row: Any, key: str) -> CheckedRow:
        """Check `row`, to be stored under the Energon sample key `key`.

        Raises:
            BadSampleError: why the loader could not train on the row.
        """
        if not isinstance(row, dict):
            raise BadSampleError("bad_json", f"the row is a {type(row).__name__}, not an object")
        check_format(row, self.row_format)
        mkey = media_key(self.row_format)
        media, members = resolve_media(row.get(mkey) if mkey else None, self.media_root)
        if self.row_format == "messages":
            out = dict(row)
            if "media" in out:
                out["media"] = media
        else:
            if self.row_format == "sharegpt":
                crude = _crude(key, {**row, "images": media}, members)
                messages = cook_sharegpt(crude).messages
            else:
                messages = alpaca_messages(row)
            out = {k: row[k] for k in ("id", "tools") if k in row}
            out["messages"] = messages
            if media:
                out["media"] = media
        # The gate: the loader's default cooker on the crude sample the loader will read.
        sample = cook_chat(_crude(key, out, members))
        if self.check_images:
            from energon_sft.families import decode_image

            for idx in image_order(sample.messages):
                decode_image(sample.media[idx])
        return CheckedRow(row=out, members=members, sample=sample)


def _crude(key: str, row: dict[str, Any], members: Sequence[tuple[str, bytes]]) -> dict[str, Any]:
    # A JSONL dataset hands the cooker a dict (a tar's .json member is bytes); both are read
    # the same way by the cookers.
    return {"__key__": key, "__restore_key__": (), "json": row, **dict(members)}


def count_lines(files: Sequence[Path]) -> int:
    """Lines in `files` (a progress total; blank lines included)."""
    total = 0
    for f in files:
        with f.open("rb") as fh:
            while block := fh.read(1 << 20):
                total += block.count(b"\n")
    return total


def _read(files: Sequence[Path]) -> Iterator[tuple[Path, int, Any]]:
    """(file, line number, parsed row or BadSampleError) for every non-blank line."""
    for f in files:
        with f.open("rb") as fh:
            for n, raw in enumerate(fh, 1):
                if n == 1:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
                if not raw.strip():
                    continue
                try:
                    yield f, n, json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    yield f, n, BadSampleError("bad_json", f"the line is not UTF-8: {exc}")
                except json.JSONDecodeError as exc:
                    yield f, n, BadSampleError("bad_json", f"not valid JSON: {exc}")


def iter_checked_rows(
    files: Sequence[Path],
    checker: RowChecker,
    report: ConvertReport,
    *,
    next_key: Callable[[Path, int], str],
    progress: Callable[[int], None] | None = None,
) -> Iterator[tuple[Path, int, CheckedRow]]:
    """Check every row of `files`; yield those that pass, count the rest in `report`.

    Args:
        files: JSONL inputs.
        checker: the row check.
        report: `rows_read` and the rejections are recorded here.
        next_key: the Energon key the row at (file, line) gets if it passes.
        progress: called with 1 per non-blank line.
    """
    for f, n, row in _read(files):
        report.rows_read += 1
        try:
            if isinstance(row, BadSampleError):
                raise row
            checked = checker(row, next_key(f, n))
        except BadSampleError as exc:
            message = str(exc).removeprefix(f"[{exc.reason}] ")
            report.reject(Rejection(file=f.name, line=n, reason=exc.reason, message=message))
        else:
            yield f, n, checked
        if progress is not None:
            progress(1)


def _clear_previous_output(out: Path, prefix: str, overwrite: bool) -> None:
    """Refuse a used folder, or with `overwrite` remove an earlier convert's shards and index."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder; pick a new output folder")
    ours = [p for p in out.iterdir() if p.name == ".nv-meta" or _is_shard(p, prefix)]
    foreign = sorted(p.name for p in out.iterdir() if p not in ours)
    if foreign or (ours and not overwrite):
        what = f"holds {foreign[:5]}" if foreign else "holds an earlier dataset"
        hint = (
            "pick an empty or new folder"
            if foreign
            else "pass --overwrite to replace it, or pick a new folder"
        )
        raise FileExistsError(f"output folder {out} {what}; {hint}")
    for p in ours:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def _is_shard(path: Path, prefix: str) -> bool:
    # A shard and the offset index energon prepare writes beside it.
    return re.fullmatch(rf"{re.escape(prefix)}-\d{{6}}\.tar(\.idx)?", path.name) is not None


def convert_files(
    jsonl: Sequence[str | Path],
    out_dir: str | Path,
    *,
    row_format: RowFormat = "messages",
    media_root: str | Path | None = None,
    samples_per_shard: int = 1000,
    max_bad_fraction: float = 0.0,
    check_images: bool = False,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    on_prepare: Callable[[int], None] | None = None,
) -> ConvertReport:
    """Validate, map and write JSONL rows as tar shards, then run `energon prepare`.

    Args:
        jsonl: input files.
        out_dir: the dataset folder; must be new or empty (or hold an earlier convert's output
            with `overwrite`).
        row_format: input format (see `energon_sft.formats`).
        media_root: base folder of relative media paths (default: the first file's folder).
        samples_per_shard: rows per tar.
        max_bad_fraction: the largest rejected share of the rows read that still converts
            (0 = every row must pass).
        check_images: decode every image (slower; catches corrupt files).
        overwrite: replace an earlier convert's shards and index in `out_dir`.
        progress: called with 1 per line read.
        on_prepare: called with the shard count when `energon prepare` starts.

    Returns:
        The report (counts, first rejections, shards, timings).

    Raises:
        FileNotFoundError: an input file is missing.
        FileExistsError: `out_dir` is in use.
        BadRowsError: no row passed, or the rejected share exceeds `max_bad_fraction`; nothing
            is left in `out_dir`.
    """
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"max_bad_fraction={max_bad_fraction} must lie in [0, 1]")
    files = [Path(p) for p in jsonl]
    if not files:
        raise ValueError("no input files given")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"input file {f} does not exist")
    if media_root is not None and not Path(media_root).is_dir():
        raise FileNotFoundError(f"media root {media_root} is not a folder")
    out = Path(out_dir)
    prefix = "chat"
    _clear_previous_output(out, prefix, overwrite)
    created = not out.exists()
    root = Path(media_root) if media_root is not None else files[0].parent
    checker = RowChecker(row_format=row_format, media_root=root, check_images=check_images)
    report = ConvertReport(files=files, out_dir=out, row_format=row_format)
    start = time.perf_counter()
    writer = ShardWriter(out, samples_per_shard=samples_per_shard, prefix=prefix)
    with writer:
        rows = iter_checked_rows(
            files, checker, report, next_key=lambda f, n: writer.next_key(), progress=progress
        )
        for _f, _n, checked in rows:
            writer.add(checked.row, checked.members)
    report.rows_written = writer.count
    report.seconds_rows = time.perf_counter() - start
    problem = _problem(report, max_bad_fraction)
    if problem is not None:
        for shard in writer.shards:
            shard.unlink(missing_ok=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise BadRowsError(problem, report)
    if on_prepare is not None:
        on_prepare(len(writer.shards))
    start = time.perf_counter()
    prepare_dataset(out)
    report.seconds_index = time.perf_counter() - start
    report.shards = writer.shards
    logger.info("convert: %s", "; ".join(report.summary_lines()))
    return report


def _problem(report: ConvertReport, max_bad_fraction: float) -> str | None:
    if report.rows_read == 0:
        return f"no rows in {', '.join(map(str, report.files))}: nothing to convert"
    if report.rows_written == 0:
        first = f"; the first: {report.examples[0]}" if report.examples else ""
        return f"none of the {report.rows_read} rows is usable{first}"
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
