"""Write chat rows as WebDataset tar shards and prepare them with `energon prepare`.

A sample is the tar members sharing a basename: `<key>.json` holds the canonical row with each
media entry replaced by its member name (`m<j><ext>`), and `<key>.m<j><ext>` holds the bytes.
Rows are copied as they are (not validated), so bad rows surface, counted, in the loader.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["convert_jsonl", "prepare_dataset", "write_chat_shards"]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def _media_entry(entry: Any, media_root: Path | None) -> tuple[Path, dict[str, Any]]:
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict) or "path" not in entry:
        raise ValueError(f"media entry {entry!r} needs a 'path' (a file relative to media_root)")
    path = Path(entry["path"])
    if not path.is_absolute():
        if media_root is None:
            raise ValueError(f"media path {str(path)!r} is relative but no media_root was given")
        path = media_root / path
    if not path.is_file():
        raise FileNotFoundError(f"media file {str(path)!r} does not exist")
    return path, {k: v for k, v in entry.items() if k != "path"}


def write_chat_shards(
    rows: Iterable[dict[str, Any]],
    out_dir: str | Path,
    *,
    media_root: str | Path | None = None,
    samples_per_shard: int = 1000,
    prefix: str = "chat",
) -> list[Path]:
    """Write rows into `out_dir/<prefix>-NNNNNN.tar` shards.

    Args:
        rows: canonical rows; `media` lists file paths (relative to `media_root`) or
            `{"path": ..., ...}` objects.
        out_dir: created if missing.
        media_root: base folder of relative media paths.
        samples_per_shard: rows per tar.
        prefix: shard file name prefix.

    Returns:
        The shard paths written.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard={samples_per_shard} must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(media_root) if media_root is not None else None
    shards: list[Path] = []
    tar: tarfile.TarFile | None = None
    for i, row in enumerate(rows):
        if i % samples_per_shard == 0:
            if tar is not None:
                tar.close()
            shards.append(out / f"{prefix}-{len(shards):06d}.tar")
            tar = tarfile.open(shards[-1], "w")  # noqa: SIM115 (closed per shard below)
        assert tar is not None
        key = f"{i:09d}"
        row = dict(row)
        members: list[tuple[str, bytes]] = []
        media = []
        for j, entry in enumerate(row.get("media") or []):
            path, extra = _media_entry(entry, root)
            member = f"m{j}{path.suffix.lower()}"
            members.append((member, path.read_bytes()))
            media.append({"member": member, **extra} if extra else member)
        if "media" in row:
            row["media"] = media
        _add(tar, f"{key}.json", json.dumps(row, ensure_ascii=False).encode())
        for member, data in members:
            _add(tar, f"{key}.{member}", data)
    if tar is not None:
        tar.close()
    if not shards:
        raise ValueError("no rows to write")
    return shards


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


def convert_jsonl(
    jsonl: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    *,
    media_root: str | Path | None = None,
    samples_per_shard: int = 1000,
) -> Path:
    """Chat JSONL file(s) + media files -> a prepared Energon dataset in `out_dir`.

    Relative media paths resolve against `media_root`, else the JSONL file's folder.
    """
    files = [Path(jsonl)] if isinstance(jsonl, str | Path) else [Path(p) for p in jsonl]

    def rows() -> Iterable[dict[str, Any]]:
        for f in files:
            with f.open(encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as exc:
                            raise ValueError(f"{f}:{n}: not valid JSON: {exc}") from exc

    root = Path(media_root) if media_root is not None else files[0].parent
    write_chat_shards(rows(), out_dir, media_root=root, samples_per_shard=samples_per_shard)
    return prepare_dataset(out_dir)
