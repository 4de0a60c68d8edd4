"""The row check: one input row -> the canonical row, cooked by the loader's own cooker.

Every row is mapped to the canonical `messages` row (`energon_sft.formats`), its media files are
read, and the result is cooked by the loader's cooker (`cook_chat`) on the same crude sample the
loader will see: a row that passes here passes the loader's schema checks. `energon_sft.convert`
writes the rows that pass; `energon_sft.inspection` only counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from energon_sft.convert_report import ConvertReport, Rejection
from energon_sft.cookers import cook_chat, cook_sharegpt
from energon_sft.dataset import resolve_media
from energon_sft.errors import BadSampleError
from energon_sft.formats import FORMATS, RowFormat, alpaca_messages, check_format, media_key
from energon_sft.schema import ChatSample, image_order
from energon_sft.sources import RowSource, open_source, read_rows

__all__ = ["CheckedRow", "RowChecker", "count_lines", "held_out_row", "iter_checked_rows"]


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckedRow:
    """A row that passed.

    Attributes:
        row: the canonical row to write into a shard (media renamed to tar members).
        members: the media members, (name, bytes).
        sample: the cooked sample (what the loader will read).
        media_paths: the row's media as absolute file paths (inline entries as they are).
    """

    row: dict[str, Any]
    members: list[tuple[str, bytes]]
    sample: ChatSample
    media_paths: list[Any] = field(default_factory=list)


def held_out_row(checked: CheckedRow) -> dict[str, Any]:
    """The row as a held-out (evaluation) JSONL holds it: canonical, media as absolute paths."""
    row = {k: v for k, v in checked.row.items() if k != "media"}
    if checked.media_paths:
        row["media"] = checked.media_paths
    return row


def _absolute_media(entries: Any, root: Path | None) -> list[Any]:
    """A row's media list (already checked by `resolve_media`) with paths made absolute."""
    out: list[Any] = []
    for entry in entries or []:
        path = entry if isinstance(entry, str) else entry.get("path")
        if not isinstance(path, str):
            out.append(entry)  # inline {"b64": ...}
            continue
        full = Path(path) if Path(path).is_absolute() or root is None else root / path
        out.append(str(full.resolve()))
    return out


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
        entries = row.get(mkey) if mkey else None
        media, members = resolve_media(entries, self.media_root)
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
        return CheckedRow(
            row=out,
            members=members,
            sample=sample,
            media_paths=_absolute_media(entries, self.media_root),
        )


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


def iter_checked_rows(
    files: Sequence[Path | RowSource],
    checker: RowChecker,
    report: ConvertReport,
    *,
    next_key: Callable[[Path, int], str],
    progress: Callable[[int], None] | None = None,
) -> Iterator[tuple[Path, int, CheckedRow]]:
    """Check every row of `files`; yield those that pass, count the rest in `report`.

    Args:
        files: inputs (JSONL or Parquet files, save_to_disk folders, or opened sources).
        checker: the row check.
        report: `rows_read` and the rejections are recorded here.
        next_key: the Energon key the row at (file, line) gets if it passes.
        progress: called with 1 per row read.

    Yields:
        (input path, line or row number, the checked row); `report.rows_read - 1` is then the
        row's position among all rows read (what `convert_files`' `holdout` counts).
    """
    sources = [f if isinstance(f, RowSource) else open_source(f) for f in files]
    for f, n, row in read_rows(sources):
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
