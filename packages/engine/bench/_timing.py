"""What the Engine's timing benchmarks (``clip.py``, ``overhead.py``) share.

Both time a few variants in turns (:func:`train_testing.bench.alternating_medians`) and print
each variant's median with its ratio to one baseline variant.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from train_testing.bench import add_device_argument, report


def timing_parser(description: str, *, layers: int) -> argparse.ArgumentParser:
    """The options both scripts take: device, model size, repeats, ``--quick`` and ``--out``.

    Args:
        description: the script's one-line description.
        layers: the script's default ``--layers``.

    Returns:
        The parser; each script adds its own options before parsing.
    """
    parser = argparse.ArgumentParser(description=description)
    add_device_argument(parser)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke run)")
    parser.add_argument("--out", default=None, help="JSON output path")
    return parser


def report_ratios(
    title: str,
    medians: Mapping[str, float],
    *,
    baseline: str,
    columns: tuple[str, str],
    out: str | None,
    meta: Mapping[str, Any],
) -> None:
    """Print (and write as JSON) one row per variant: its median and its ratio to ``baseline``.

    Args:
        title: the table's title.
        medians: median time of each variant, in milliseconds.
        baseline: the variant the ratios divide by.
        columns: the names of the time column and of the ratio column.
        out: the JSON path, or None.
        meta: what the JSON records besides the rows.
    """
    time_column, ratio_column = columns
    base = medians[baseline]
    rows = [
        {"variant": name, time_column: ms, ratio_column: ms / base} for name, ms in medians.items()
    ]
    report(title, rows, ["variant", *columns], out, meta)
