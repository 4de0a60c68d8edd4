"""Write chat rows as WebDataset tar shards and prepare them with `energon prepare`.

A sample is the tar members sharing a basename: `<key>.json` holds the canonical row with each
media entry replaced by its member name (`m<j><ext>`), and `<key>.m<j><ext>` holds the bytes.
`write_chat_shards` copies rows as they are (not validated), so tests can plant bad rows that
surface, counted, in the loader; `energon_sft.convert` (`convert_jsonl`, the `energon-sft
convert` path) validates every row first.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from energon_sft.errors import BadSampleError

logger = logging.getLogger(__name__)

__all__ = ["ShardWriter", "prepare_dataset", "resolve_media", "write_chat_shards"]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def _media_file(entry: dict[str, Any], j: int, media_root: Path | None) -> Path:
    path = Path(entry["path"])
    if not path.is_absolute():
        if media_root is None:
            raise BadSampleError(
                "missing_media",
                f"media[{j}] path {str(path)!r} is relative but no media root was given",
            )
        path = media_root / path
    if not path.is_file():
        raise BadSampleError("missing_media", f"media[{j}] file {str(path)!r} does not exist")
    return path


def resolve_media(
    entries: Any, media_root: Path | None
) -> tuple[list[Any], list[tuple[str, bytes]]]:
    """Read the media files a row lists and name the tar members that will hold them.

    Args:
        entries: the row's media list: file paths (relative to `media_root`),
            `{"path": ..., ...}` objects, or inline `{"b64": ...}` objects (kept as they are).
        media_root: base folder of relative paths.

    Returns:
        (the media list to write into the row, [(member name, bytes)]); member `j` is
        `m<j><ext>`.

    Raises:
        BadSampleError: reason `missing_media` (file absent) or `missing_field` (bad entry).
    """
    if entries is None:
        return [], []
    if not isinstance(entries, list):
        raise BadSampleError("missing_field", "the media list must be a list of file paths")
    media: list[Any] = []
    members: list[tuple[str, bytes]] = []
    for j, entry in enumerate(entries):
        if isinstance(entry, str):
            entry = {"path": entry}
        if isinstance(entry, dict) and "b64" in entry:
            media.append(entry)
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise BadSampleError(
                "missing_field",
                f"media[{j}] = {entry!r} needs a 'path' (a file relative to the media root) "
                "or inline 'b64'",
            )
        path = _media_file(entry, j, media_root)
        member = f"m{j}{path.suffix.lower()}"
        try:
            members.append((member, path.read_bytes()))
        except OSError as exc:
            raise BadSampleError("missing_media", f"media[{j}]: cannot read {path}: {exc}") from exc
        extra = {k: v for k, v in entry.items() if k != "path"}
        media.append({"member": member, **extra} if extra else member)
    return media, members


class ShardWriter:
    """Append samples to `out_dir/<prefix>-NNNNNN.tar`, `samples_per_shard` per tar.

    Sample `i` is written under key `f"{i:09d}"`: `<key>.json` plus `<key>.<member>` per media
    member. Use as a context manager (or call `close`) so the last tar is complete.

    Args:
        out_dir: created if missing.
        samples_per_shard: samples per tar (>= 1).
        prefix: shard file name prefix.
    """

    def __init__(
        self, out_dir: str | Path, *, samples_per_shard: int, prefix: str = "chat"
    ) -> None:
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard={samples_per_shard} must be >= 1")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.samples_per_shard = samples_per_shard
        self.prefix = prefix
        self.shards: list[Path] = []
        self.count = 0
        self._tar: tarfile.TarFile | None = None

    def next_key(self) -> str:
        """The key the next `add` writes under."""
        return f"{self.count:09d}"

    def add(self, row: dict[str, Any], members: Sequence[tuple[str, bytes]] = ()) -> str:
        """Write one sample; returns its key."""
        if self.count % self.samples_per_shard == 0:
            self._close_tar()
            self.shards.append(self.out_dir / f"{self.prefix}-{len(self.shards):06d}.tar")
            self._tar = tarfile.open(self.shards[-1], "w")  # noqa: SIM115 (closed in _close_tar)
        assert self._tar is not None
        key = self.next_key()
        _add(self._tar, f"{key}.json", json.dumps(row, ensure_ascii=False).encode())
        for member, data in members:
            _add(self._tar, f"{key}.{member}", data)
        self.count += 1
        return key

    def _close_tar(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def close(self) -> None:
        """Finish the current tar."""
        self._close_tar()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_chat_shards(
    rows: Iterable[dict[str, Any]],
    out_dir: str | Path,
    *,
    media_root: str | Path | None = None,
    samples_per_shard: int = 1000,
    prefix: str = "chat",
) -> list[Path]:
    """Write rows, unvalidated, into `out_dir/<prefix>-NNNNNN.tar` shards.

    Args:
        rows: rows of any format; `media` lists file paths (relative to `media_root`),
            `{"path": ..., ...}` objects or inline `{"b64": ...}`.
        out_dir: created if missing.
        media_root: base folder of relative media paths.
        samples_per_shard: rows per tar.
        prefix: shard file name prefix.

    Returns:
        The shard paths written.

    Raises:
        BadSampleError: a media file is missing (reason `missing_media`).
    """
    root = Path(media_root) if media_root is not None else None
    with ShardWriter(out_dir, samples_per_shard=samples_per_shard, prefix=prefix) as writer:
        for row in rows:
            row = dict(row)
            media, members = resolve_media(row.get("media"), root)
            if "media" in row:
                row["media"] = media
            writer.add(row, members)
    if not writer.shards:
        raise ValueError("no rows to write")
    return writer.shards


def prepare_dataset(
    path: str | Path, *, split_ratio: str = "1,0,0", force_overwrite: bool = True
) -> Path:
    """Run `energon prepare` non-interactively on a folder of tar shards or a `.jsonl` file.

    Every shard goes to the split of `split_ratio` (splits are per shard; the default puts
    all into train). A JSONL file is indexed as one crude dataset (rows arrive as dicts; it
    has no media members, so media must be inline `{"b64": ...}`). Raises `RuntimeError`
    with energon's output when prepare fails.
    """
    from click.testing import CliRunner
    from megatron.energon.cli.main import main as energon_main

    if Path(path).suffix == ".jsonl":
        result = CliRunner().invoke(energon_main, ["prepare", str(path)], catch_exceptions=True)
        if result.exit_code != 0:
            raise RuntimeError(
                f"energon prepare {path} failed with exit code {result.exit_code}:\n{result.output}"
            ) from result.exception
        return Path(path)
    args = [
        "prepare",
        "--non-interactive",
        "--split-ratio",
        split_ratio,
        "--sample-type",
        "CrudeWebdataset",
        "--num-workers",
        "1",
        "--no-progress",
    ]
    if force_overwrite:
        args.append("--force-overwrite")
    args.append(str(path))
    result = CliRunner().invoke(energon_main, args, catch_exceptions=True)
    if result.exit_code != 0:
        raise RuntimeError(
            f"energon prepare {path} failed with exit code {result.exit_code}:\n{result.output}"
        ) from result.exception
    logger.info("energon prepare %s: done", path)
    return Path(path)
