"""Per-file checksums of a checkpoint, verified at load before any state is touched.

Each rank computes them at save for the files it wrote; at load the work is split over the
ranks.

The checksum is CRC-32 (``zlib.crc32``, streamed in 8 MiB chunks) plus the file size. It is
in the standard library, runs at memory speed (hardware CRC in zlib / zlib-ng), and detects
every burst error up to 32 bits and any random corruption with probability 1 - 2^-32; the
size catches truncation before any byte is read. It is not a cryptographic hash: it protects
against disks, networks and interrupted copies, not against someone forging a checkpoint
(which ``torch.load(weights_only=False)`` could not protect against anyway).
"""

from __future__ import annotations

import zlib
from pathlib import Path

__all__ = [
    "ALGORITHM",
    "assign_to_ranks",
    "checksum_files",
    "files_written_by",
    "mismatches",
]

ALGORITHM = "crc32"
_CHUNK = 8 << 20

# relative path -> {"size": bytes, "crc32": 8 hex digits}
Checksums = dict[str, dict[str, int | str]]


def _checksum(path: Path) -> dict[str, int | str]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, ALGORITHM: f"{crc:08x}"}


def checksum_files(root: Path, files: list[Path]) -> Checksums:
    """Checksums of ``files``, keyed by their path relative to ``root`` (POSIX form)."""
    return {path.relative_to(root).as_posix(): _checksum(path) for path in files}


def files_written_by(root: Path, rank: int, *, dcp_dir: str) -> list[Path]:
    """The files of a checkpoint at ``root`` that ``rank`` wrote, as far as names tell.

    DCP's file writer names each rank's data ``__<rank>_<n>.distcp`` and lets rank 0 write
    ``.metadata``. This is only a way to split the hashing: the coordinator hashes whatever
    no rank claimed, so a change of DCP's naming costs time, not correctness.
    """
    own = [*sorted((root / dcp_dir).glob(f"__{rank}_*.distcp")), root / f"rank_{rank:05d}.pt"]
    return [path for path in own if path.is_file()]


def assign_to_ranks(files: Checksums, world: int) -> list[list[str]]:
    """Split the files over ``world`` ranks with balanced bytes (largest first, greedy).

    Deterministic: every rank computes the same split from the same marker.
    """
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for name in sorted(files, key=lambda n: (-int(files[n]["size"]), n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += int(files[name]["size"])
    return shares


def mismatches(root: Path, files: Checksums, names: list[str]) -> list[str]:
    """One line per file of ``names`` that is missing, truncated, unreadable or altered."""
    problems = []
    for name in names:
        path = root / name
        want = files[name]
        try:
            size = path.stat().st_size
            if size != want["size"]:
                problems.append(
                    f"{path}: {size} bytes, the save recorded {want['size']} (truncated or "
                    "overwritten)"
                )
                continue
            got = _checksum(path)
        except OSError as err:
            problems.append(f"{path}: unreadable ({type(err).__name__}: {err})")
            continue
        if got[ALGORITHM] != want[ALGORITHM]:
            problems.append(
                f"{path}: {ALGORITHM} {got[ALGORITHM]}, the save recorded {want[ALGORITHM]} "
                "(the bytes changed after the save)"
            )
    return problems
