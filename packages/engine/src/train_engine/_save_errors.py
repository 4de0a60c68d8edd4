"""Why a checkpoint save failed, in one line: the OS error, the bytes written and free.

torch hides the OS error of a failed write in two ways. The distributed checkpoint gathers each
rank's exception into a ``CheckpointException`` (a BaseException whose text is every rank's
traceback), and ``torch.save`` into a file reports a short write as ``RuntimeError: [enforce
fail at inline_container.cc:...] unexpected pos N vs M``, without the errno. So the errno is
looked for along the exception's causes and DCP's per-rank failures; when none carries one, the
free space left on the checkpoint's filesystem after the failure tells a full disk (ENOSPC)
from other failures.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

__all__ = ["FULL_BELOW", "describe_failure", "format_size", "free_disk_bytes", "tree_bytes"]

# Free bytes under which a write failure without an errno is read as a full disk: a write that
# ran out of space leaves at most a partial block free (f_bavail already excludes ext4's
# reserve for root), while any other failure leaves the disk as it was.
FULL_BELOW = 64 << 20


def _causes(exc: BaseException) -> list[tuple[BaseException, int | None]]:
    """``exc``, DCP's per-rank exceptions and every cause and context, once each.

    Each comes with the rank DCP says it failed on (None outside DCP's failures).
    """
    found: list[tuple[BaseException, int | None]] = []
    todo: list[tuple[BaseException | None, int | None]] = [(exc, None)]
    while todo:
        item, rank = todo.pop(0)
        if item is None or any(item is seen for seen, _ in found):
            continue
        found.append((item, rank))
        # torch.distributed.checkpoint.api.CheckpointException: {rank: (exception, stack)}.
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            todo += [(f[0], r) for r, f in sorted(failures.items()) if isinstance(f, tuple) and f]
        todo += [(item.__cause__, rank), (item.__context__, rank)]
    return found


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def describe_failure(exc: BaseException) -> tuple[int | None, str, int | None]:
    """The OS error behind a failed save: (errno or None, one line naming it, DCP's rank).

    With an errno: ``"ENOSPC (No space left on device)"``. Without one, the first line of the
    innermost failure (DCP's first failing rank's exception, not its multi-line summary). The
    rank is the one DCP reports the failure from (None when it did not come through DCP).
    """
    causes = _causes(exc)
    for cause, rank in causes:
        if isinstance(cause, OSError) and cause.errno is not None:
            name = errno.errorcode.get(cause.errno, f"errno {cause.errno}")
            return cause.errno, f"{name} ({cause.strerror or os.strerror(cause.errno)})", rank
    inner = [(c, r) for c, r in causes if getattr(c, "failures", None) is None]
    cause, rank = inner[0] if inner else (exc, None)
    return None, _first_line(cause), rank


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed meanwhile
                continue
    return total


def free_disk_bytes(path: Path) -> int | None:
    """Bytes an unprivileged user may still write on ``path``'s filesystem (None: unknown).

    ``path`` need not exist: its nearest existing ancestor is asked.
    """
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def format_size(size: int) -> str:
    """``123 bytes``, ``4.2 MiB`` or ``104.3 GiB``."""
    if size < 1 << 20:
        return f"{size} bytes"
    if size < 1 << 30:
        return f"{size / (1 << 20):.1f} MiB"
    return f"{size / (1 << 30):.1f} GiB"
