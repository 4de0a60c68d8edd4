"""The tests' side of a benchmark: run its ``--quick`` mode in a subprocess and read its JSON.

Each package's ``tests/test_bench*.py`` keeps its script working this way (tiny sizes, no timing
asserted). A wheel ships no ``bench/`` folder, so where the script is absent the test skips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(kw_only=True, slots=True, frozen=True)
class QuickRun:
    """What one ``--quick`` run left.

    Attributes:
        report: the JSON file the script wrote, parsed.
        stdout: everything it printed (its tables).
        out: the JSON file's path (in the test's ``tmp_path``; other files may sit beside it).
    """

    report: dict[str, Any]
    stdout: str
    out: Path


def run_quick(
    script: Path,
    tmp_path: Path,
    *args: str,
    out_flag: str = "--out",
    timeout_s: float = 240.0,
) -> QuickRun:
    """Run ``python script --quick *args <out_flag> <tmp_path>/<script>.json`` and check it.

    Args:
        script: the benchmark script; the test skips when it is absent (an installed wheel).
        tmp_path: the test's temporary folder; the JSON goes there.
        *args: further options, e.g. ``"--device", "cpu"``.
        out_flag: the script's option naming its JSON output.
        timeout_s: the subprocess is killed after this (keep it below the test's timeout).

    Returns:
        The parsed JSON and the printed output.

    Raises:
        AssertionError: the script exited non-zero (the message holds the end of its output).
    """
    if not script.is_file():
        pytest.skip(f"bench script not shipped here ({script}); the scripts live in the repository")
    out = tmp_path / f"{script.stem}.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", *args, out_flag, str(out)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{script.name} --quick exited with {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return QuickRun(report=json.loads(out.read_text()), stdout=proc.stdout, out=out)
