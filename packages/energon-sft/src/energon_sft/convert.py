"""Chat rows -> a prepared Energon dataset, keeping only rows the loader can train on.

The rows come from JSONL files, Parquet files or `datasets.save_to_disk` folders
(`energon_sft.sources`). Every row passes the row check (`energon_sft.row_check`: the canonical
row cooked by the loader's own cooker) before it is written, so a rejected row is reported with
its file, line and reason instead of surfacing, counted, at training time. What needs the
tokenizer (template rendering, over-long rows) is checked by `energon-sft inspect`.

Rows can be held out (`holdout`): they pass the same checks and go to a JSONL of canonical rows
(`held_out_row`: media as absolute paths) instead of the shards, so they are never trained on.
`convert_to_jsonl` writes every row that way (an evaluation file in another format).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import nullcontext
from pathlib import Path

from energon_sft.convert_report import BadRowsError, ConvertReport, Rejection, problem
from energon_sft.dataset import ShardWriter, prepare_dataset
from energon_sft.formats import RowFormat
from energon_sft.row_check import (
    CheckedRow,
    RowChecker,
    count_lines,
    held_out_row,
    iter_checked_rows,
)
from energon_sft.sources import RowSource, open_source

logger = logging.getLogger(__name__)

__all__ = [
    "BadRowsError",
    "CheckedRow",
    "ConvertReport",
    "Rejection",
    "RowChecker",
    "convert_files",
    "convert_jsonl",
    "convert_to_jsonl",
    "count_lines",
    "held_out_row",
    "iter_checked_rows",
]


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


def _open_inputs(inputs: Sequence[str | Path], media_root: str | Path | None) -> list[RowSource]:
    if not inputs:
        raise ValueError("no input files given")
    sources = []
    for f in inputs:
        try:
            sources.append(open_source(f))
        except ValueError as exc:
            raise FileNotFoundError(str(exc)) from None
    if media_root is not None and not Path(media_root).is_dir():
        raise FileNotFoundError(f"media root {media_root} is not a folder")
    return sources


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
    holdout: Collection[int] = (),
    holdout_path: str | Path | None = None,
) -> ConvertReport:
    """Validate, map and write rows as tar shards, then run `energon prepare`.

    Args:
        jsonl: inputs: JSONL files, Parquet files, `datasets.save_to_disk` folders.
        out_dir: the dataset folder; must be new or empty (or hold an earlier convert's output
            with `overwrite`).
        row_format: input format (see `energon_sft.formats`).
        media_root: base folder of relative media paths (default: the first input's folder).
        samples_per_shard: rows per tar.
        max_bad_fraction: the largest rejected share of the rows read that still converts
            (0 = every row must pass).
        check_images: decode every image (slower; catches corrupt files).
        overwrite: replace an earlier convert's shards and index in `out_dir`.
        progress: called with 1 per row read.
        on_prepare: called with the shard count when `energon prepare` starts.
        holdout: positions (0-based, among all rows read, in order) of rows to hold out: if
            they pass, they go to `holdout_path` (`held_out_row`) instead of the shards.
        holdout_path: the held-out JSONL to write (needed with `holdout`).

    Returns:
        The report (counts, first rejections, shards, timings).

    Raises:
        FileNotFoundError: an input is missing or of an unknown kind.
        FileExistsError: `out_dir` is in use.
        BadRowsError: no row passed, every passing row was held out, or the rejected share
            exceeds `max_bad_fraction`; nothing is left in `out_dir` or at `holdout_path`.
    """
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"max_bad_fraction={max_bad_fraction} must lie in [0, 1]")
    if holdout and holdout_path is None:
        raise ValueError("holdout rows need a holdout_path to be written to")
    sources = _open_inputs(jsonl, media_root)
    out = Path(out_dir)
    prefix = "chat"
    _clear_previous_output(out, prefix, overwrite)
    created = not out.exists()
    root = Path(media_root) if media_root is not None else sources[0].path.parent
    checker = RowChecker(row_format=row_format, media_root=root, check_images=check_images)
    report = ConvertReport(files=[s.path for s in sources], out_dir=out, row_format=row_format)
    held = Path(holdout_path) if holdout_path is not None else None
    report.held_out_path = held
    start = time.perf_counter()
    writer = ShardWriter(out, samples_per_shard=samples_per_shard, prefix=prefix)
    with writer, held.open("w", encoding="utf-8") if held else nullcontext() as held_file:
        rows = iter_checked_rows(
            sources, checker, report, next_key=lambda f, n: writer.next_key(), progress=progress
        )
        for _f, _n, checked in rows:
            if report.rows_read - 1 in holdout:
                assert held_file is not None
                held_file.write(json.dumps(held_out_row(checked), ensure_ascii=False) + "\n")
                report.rows_held_out += 1
            else:
                writer.add(checked.row, checked.members)
    report.rows_written = writer.count
    report.seconds_rows = time.perf_counter() - start
    refusal = problem(report, max_bad_fraction)
    if refusal is not None:
        for shard in writer.shards:
            shard.unlink(missing_ok=True)
        if held is not None:
            held.unlink(missing_ok=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise BadRowsError(refusal, report)
    if on_prepare is not None:
        on_prepare(len(writer.shards))
    start = time.perf_counter()
    prepare_dataset(out)
    report.seconds_index = time.perf_counter() - start
    report.shards = writer.shards
    logger.info("convert: %s", "; ".join(report.summary_lines()))
    return report


def convert_to_jsonl(
    inputs: Sequence[str | Path],
    out_file: str | Path,
    *,
    row_format: RowFormat = "messages",
    media_root: str | Path | None = None,
    max_bad_fraction: float = 0.0,
    progress: Callable[[int], None] | None = None,
) -> ConvertReport:
    """Validate and map rows into one JSONL of canonical rows (`held_out_row` form).

    What an evaluation file in another format (ShareGPT, Alpaca, Parquet, ...) becomes: the
    rows pass the checks `convert_files` makes, media keep their files (absolute paths).

    Raises:
        FileNotFoundError: an input is missing or of an unknown kind.
        BadRowsError: no row passed, or the rejected share exceeds `max_bad_fraction`;
            `out_file` is not left behind.
    """
    sources = _open_inputs(inputs, media_root)
    out = Path(out_file)
    root = Path(media_root) if media_root is not None else sources[0].path.parent
    checker = RowChecker(row_format=row_format, media_root=root)
    report = ConvertReport(files=[s.path for s in sources], out_dir=out, row_format=row_format)
    start = time.perf_counter()
    with out.open("w", encoding="utf-8") as fh:
        for _f, _n, checked in iter_checked_rows(
            sources, checker, report, next_key=lambda f, n: f"{n:09d}", progress=progress
        ):
            fh.write(json.dumps(held_out_row(checked), ensure_ascii=False) + "\n")
            report.rows_written += 1
    report.seconds_rows = time.perf_counter() - start
    refusal = problem(report, max_bad_fraction)
    if refusal is not None:
        out.unlink(missing_ok=True)
        raise BadRowsError(refusal, report)
    return report


def convert_jsonl(
    jsonl: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    *,
    media_root: str | Path | None = None,
    samples_per_shard: int = 1000,
    row_format: str = "messages",
    max_bad_fraction: float = 0.0,
) -> Path:
    """Chat JSONL file(s) + media files -> a prepared Energon dataset in `out_dir`.

    Every row is validated first (`convert_files`, which also returns the counts); an earlier
    convert's output in `out_dir` is replaced. Relative media paths resolve against
    `media_root`, else the first JSONL file's folder.

    Raises:
        BadRowsError: no usable row, or more rejected than `max_bad_fraction` of the rows.
    """
    files = [jsonl] if isinstance(jsonl, str | Path) else list(jsonl)
    report = convert_files(
        files,
        out_dir,
        row_format=row_format,  # type: ignore[arg-type]
        media_root=media_root,
        samples_per_shard=samples_per_shard,
        max_bad_fraction=max_bad_fraction,
        overwrite=True,
    )
    return report.out_dir
