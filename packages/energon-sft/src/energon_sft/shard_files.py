"""The files of a prepared dataset: every shard and its index present and consistent.

Energon reads sample ``i`` of a shard through the shard's ``.tar.idx`` (one little-endian
uint64 byte offset per sample, plus the end of the last one) and counts the samples from
``.nv-meta/.info.json``. A truncated or damaged index fails deep inside a loader worker with an
error that names no file (``IndexError: Index 700 out of range``, ``No valid files found in
sample ITarSamplePointer(...)``). These checks name the file and the fix instead:

- :func:`check_shard_files` (cheap: sizes and one read of 8 bytes per shard) runs where a loader
  is built, before any worker starts;
- :func:`diagnose_read_error` reads every index in full, once a read has failed, to tell a damaged
  file (:class:`ShardFileError`) from another error (returned None: re-raise that one).

A metadataset YAML is followed to the prepared folders it names; a JSONL dataset is not checked.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["ShardFileError", "check_shard_files", "diagnose_read_error"]

_OFFSET = struct.Struct("<Q")  # Energon's TarIndexWriter: struct.pack("Q", offset), x86/ARM order


class ShardFileError(RuntimeError):
    """A shard or shard index of a prepared dataset is missing, truncated or damaged.

    Attributes:
        path: the file at fault.
        problem: what is wrong with it.
        dataset: the prepared folder it belongs to.
    """

    def __init__(self, path: Path, problem: str, dataset: Path) -> None:
        convert = f"`energon-sft convert --overwrite SOURCE {dataset}`"
        if path.suffix == ".tar":  # the samples themselves: only their source rebuilds them
            fix = f"rebuild the dataset from its source with {convert}"
        else:
            fix = (
                f"rebuild the index with `energon prepare --tar-index-only --non-interactive "
                f"{dataset}` (the shards are kept), or the dataset with {convert}"
            )
        super().__init__(f"{path}: {problem}; {fix}")
        self.path, self.problem, self.dataset = path, problem, dataset


def check_shard_files(dataset: str | Path, *, deep: bool = False) -> None:
    """Check that every shard of ``dataset`` and its index are there and agree.

    Args:
        dataset: a prepared folder (with ``.nv-meta``), a metadataset YAML, or anything else
            (not checked).
        deep: also read each index in full (offsets ascending, within the shard); else only
            its size and last offset.

    Raises:
        ShardFileError: naming the first file at fault and how to rebuild it.
    """
    for folder in _prepared_folders(Path(dataset)):
        for name, count in _shard_counts(folder).items():
            _check_shard(folder, folder / name, int(count), deep=deep)


def diagnose_read_error(dataset: str | Path, error: BaseException) -> ShardFileError | None:
    """The :class:`ShardFileError` behind a failed read of ``dataset``, or None.

    None means the files are sound: ``error`` is something else (re-raise it). The error's own
    line goes in the message.
    """
    try:
        check_shard_files(dataset, deep=True)
    except ShardFileError as found:
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        if "Traceback" in str(error) and lines:  # a loader worker's, ending "Type: message"
            said = lines[-1]
        else:
            said = f"{type(error).__name__}: {lines[0] if lines else ''}"
        return ShardFileError(
            found.path, f"{found.problem} (reading it failed with {said})", found.dataset
        )
    return None


def _prepared_folders(path: Path) -> Iterator[Path]:
    """The prepared dataset folders behind ``path`` (a folder, or a metadataset YAML)."""
    if path.is_dir():
        if (path / ".nv-meta").is_dir():
            yield path
        return
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        return
    import yaml

    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return  # Energon reports an unreadable metadataset itself
    seen: set[Path] = set()
    for ref in _paths_in(spec):
        target = (path.parent / ref).resolve()
        if target not in seen:
            seen.add(target)
            yield from _prepared_folders(target)


def _paths_in(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("path")
        if isinstance(ref, str):
            yield ref
        for value in node.values():
            yield from _paths_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from _paths_in(value)


def _shard_counts(folder: Path) -> dict[str, int]:
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.metadata import get_dataset_info

    meta = folder / ".nv-meta"
    try:
        info = get_dataset_info(EPath(folder))
    except FileNotFoundError:
        raise ShardFileError(meta / ".info.json", "missing", folder) from None
    except ValueError as err:
        raise ShardFileError(meta / ".info.json", f"unreadable ({err})", folder) from None
    counts = info.get("shard_counts") if isinstance(info, dict) else None
    if not isinstance(counts, dict):
        raise ShardFileError(meta / ".info.json", "has no shard_counts", folder)
    return counts


def _check_shard(folder: Path, tar: Path, count: int, *, deep: bool) -> None:
    index = tar.with_name(tar.name + ".idx")
    for path in (tar, index):
        if not path.is_file():
            raise ShardFileError(path, "missing (listed in .nv-meta/.info.json)", folder)
    size, tar_size = index.stat().st_size, tar.stat().st_size
    want = _OFFSET.size * (count + 1)  # one offset per sample, then the end of the last
    if size != want:
        what = "truncated" if size < want else "longer than expected"
        raise ShardFileError(
            index,
            f"{what}: {size} bytes where {count} samples need {want} (8 per sample, plus 8)",
            folder,
        )
    with index.open("rb") as f:
        if deep:
            offsets = [o for (o,) in _OFFSET.iter_unpack(f.read())]
        else:
            f.seek(-_OFFSET.size, 2)
            offsets = [_OFFSET.unpack(f.read(_OFFSET.size))[0]]
    if offsets[-1] > tar_size:
        raise ShardFileError(
            tar,
            f"truncated: {tar_size} bytes, but its index ends the last sample at byte "
            f"{offsets[-1]}",
            folder,
        )
    if any(b < a for a, b in itertools.pairwise(offsets)):
        raise ShardFileError(index, "damaged: its sample offsets are not in order", folder)
