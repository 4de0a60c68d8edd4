"""What a benchmark prints and writes: number formatting, tables, JSON files, the environment.

Every function writes to stdout through ``sys.stdout`` (a benchmark's table is its output, not a
log record) and imports nothing but torch, so the scripts run where only the wheels are
installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def fmt(value: Any, *, none: str = "") -> str:
    """A table cell: floats to 4 significant digits, ``None`` as ``none``, the rest as ``str``."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return none if value is None else str(value)


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    *,
    cell: Callable[[Any], str] = fmt,
) -> list[str]:
    """The lines of a fixed-width table: a header of ``columns``, then one line per row.

    Args:
        rows: one mapping per line; a missing key is an empty cell (``cell(None)``).
        columns: the keys to show, in order; each column is as wide as its widest cell.
        cell: how a value is written (``fmt`` by default).

    Returns:
        ``len(rows) + 1`` lines, cells left-aligned and separated by two spaces.
    """
    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)]
    header = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    return [header] + [
        "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in cells
    ]


def print_lines(*lines: str) -> None:
    """Write ``lines`` to stdout, one per line, and flush (the output of a long run shows up)."""
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    *,
    title: str | None = None,
    cell: Callable[[Any], str] = fmt,
) -> None:
    """Print :func:`format_table`, after a blank line and ``title`` when one is given."""
    head = [] if title is None else ["", title]
    print_lines(*head, *format_table(rows, columns, cell=cell))


def write_json(path: str | Path, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` as indented JSON, creating the folder; atomic (a reader never sees half).

    Values JSON cannot hold (a dtype, a path) are written as their ``str``.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)
    return path


def report(
    title: str,
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    out: str | Path | None,
    meta: Mapping[str, Any],
) -> None:
    """Print a table of ``rows`` and write ``{"meta": meta, "rows": rows}`` to ``out`` if given."""
    print_table(rows, columns, title=title)
    if out:
        print_lines(f"wrote {write_json(out, {'meta': meta, 'rows': list(rows)})}")


def device_name(device: str | torch.device) -> str:
    """The GPU's name on CUDA, else the processor's (the machine type where that is empty)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index)
    return platform.processor() or platform.machine()


def versions(*distributions: str) -> dict[str, str]:
    """The versions of torch, Python and each distribution named (or "not installed")."""
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for name in distributions:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def environment(device: str | torch.device) -> dict[str, Any]:
    """The record a single-process benchmark puts in its JSON: versions, device, threads."""
    return {
        **versions(),
        "device": str(device),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
    }
