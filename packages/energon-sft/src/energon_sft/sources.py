"""Where convert reads rows from: JSONL files, Parquet files, `datasets.save_to_disk` folders.

Each source yields `(path, number, row)`: the file (or folder) and the row's line (JSONL, blank lines
skipped but counted) or its 1-based position (Parquet, Arrow), so a rejected row is reported
where the user finds it. A row that is not valid JSON is yielded as a `BadSampleError`.

Parquet and Arrow are read with pyarrow (the `parquet` extra), imported only for them. Arrow
gives every struct every field of its schema, absent ones as null; a null field is dropped, so a
message without `tool_calls` reads as it would from JSONL (bytes become base64 text, dates and
decimals strings, so every row can be written as JSON). A `save_to_disk` folder of one
`Dataset` lists its Arrow files in `state.json`; a `DatasetDict` folder (`dataset_dict.json`,
one sub-folder per split) is refused with the split folders to name instead.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from energon_sft.errors import BadSampleError

__all__ = [
    "RowSource",
    "SourceKind",
    "count_rows",
    "dataset_dict_splits",
    "open_source",
    "read_rows",
]

SourceKind = Literal["jsonl", "parquet", "arrow"]

#: Rows per Arrow record batch converted to Python objects at a time.
_BATCH_ROWS = 1024


@dataclass(kw_only=True, slots=True, frozen=True)
class RowSource:
    """One input of convert.

    Attributes:
        path: the file, or the `save_to_disk` folder.
        kind: "jsonl", "parquet" or "arrow" (a `save_to_disk` folder).
        files: the files read, in order (the folder's Arrow files; else `path`).
    """

    path: Path
    kind: SourceKind
    files: tuple[Path, ...]


def dataset_dict_splits(folder: Path) -> list[str] | None:
    """The splits of a `DatasetDict.save_to_disk` folder (None when `folder` is not one)."""
    meta = folder / "dataset_dict.json"
    if not meta.is_file():
        return None
    return [str(s) for s in json.loads(meta.read_text()).get("splits", [])]


def _arrow_files(folder: Path) -> tuple[Path, ...]:
    state = folder / "state.json"
    if state.is_file():
        names = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
        files = tuple(folder / n for n in names)
    else:
        files = tuple(sorted(folder.glob("*.arrow")))
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lists Arrow files that are missing: {missing[:3]}")
    return files


def open_source(path: str | Path) -> RowSource:
    """Recognise an input by its name and contents.

    Raises:
        FileNotFoundError: `path` does not exist, or a folder's Arrow files are missing.
        ValueError: a folder that is not a `datasets.save_to_disk` folder of one split, or a
            file that is neither `.jsonl`/`.json` nor `.parquet`.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"input file {p} does not exist")
    if p.is_dir():
        splits = dataset_dict_splits(p)
        if splits is not None:
            raise ValueError(
                f"{p} holds a DatasetDict with splits {splits}; name one split's folder, "
                f"e.g. {p / (splits[0] if splits else 'train')}"
            )
        files = _arrow_files(p)
        if not files:
            raise ValueError(
                f"{p} is a folder without Arrow files; expected a folder written by "
                "datasets' save_to_disk (state.json + data-*.arrow)"
            )
        return RowSource(path=p, kind="arrow", files=files)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return RowSource(path=p, kind="jsonl", files=(p,))
    if suffix in (".parquet", ".pq"):
        return RowSource(path=p, kind="parquet", files=(p,))
    raise ValueError(
        f"{p}: unknown input type {suffix or '(no suffix)'}; expected a chat JSONL (.jsonl), "
        "a Parquet file (.parquet) or a datasets.save_to_disk folder"
    )


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ImportError(
            "reading Parquet files and save_to_disk folders needs pyarrow: "
            "pip install 'energon-sft[parquet]'"
        ) from None
    return pyarrow


def _plain(value: Any) -> Any:
    """An Arrow row as JSON-able data.

    Null fields are dropped, bytes become base64 text and the scalars JSON lacks (dates,
    decimals) strings.
    """
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _batches(source: RowSource) -> Iterator[Any]:
    """The record batches of a Parquet or Arrow source."""
    pa = _pyarrow()
    if source.kind == "parquet":
        yield from pa.parquet.ParquetFile(source.path).iter_batches(batch_size=_BATCH_ROWS)
        return
    for f in source.files:
        with pa.memory_map(str(f)) as mm:
            try:  # save_to_disk writes the IPC stream format; plain Arrow files are read too
                reader = pa.ipc.open_stream(mm)
            except pa.ArrowInvalid:
                mm.seek(0)
                file_reader = pa.ipc.open_file(mm)
                for i in range(file_reader.num_record_batches):
                    yield file_reader.get_batch(i)
                continue
            yield from reader


def _read_jsonl(f: Path) -> Iterator[tuple[Path, int, Any]]:
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


def read_rows(sources: Sequence[RowSource]) -> Iterator[tuple[Path, int, Any]]:
    """(source path, line or row number, parsed row or BadSampleError) for every row."""
    for source in sources:
        if source.kind == "jsonl":
            yield from _read_jsonl(source.path)
            continue
        n = 0
        for batch in _batches(source):
            for row in batch.to_pylist():
                n += 1
                yield source.path, n, _plain(row)


def count_rows(sources: Sequence[RowSource]) -> int:
    """Rows the sources hold (JSONL: non-blank lines), without parsing them."""
    total = 0
    for source in sources:
        if source.kind == "jsonl":
            with source.path.open("rb") as fh:
                total += sum(1 for line in fh if line.strip())
        elif source.kind == "parquet":
            total += _pyarrow().parquet.ParquetFile(source.path).metadata.num_rows
        else:
            total += sum(batch.num_rows for batch in _batches(source))
    return total
