"""The GPU board's power draw and SM clock while a benchmark's timed part runs (``nvidia-smi``).

A loop that holds the board at its power limit runs at lower clocks than its kernels do alone,
and then its time follows the energy of its work rather than its idle gaps. Sampling the board
during the timed part says whether a comparison was made in that regime (both sides alike).
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterator

import torch

# What each sample holds, in this order (nvidia-smi's field names).
_QUERY = ("power.draw", "clocks.sm", "power.limit", "clocks.max.sm")


def smi_gpu_id(device_index: int) -> str:
    """The ``nvidia-smi -i`` id of torch's CUDA device ``device_index``.

    Its UUID, which names the same board whatever ``CUDA_VISIBLE_DEVICES`` or the enumeration
    order is (torch's device index need not be nvidia-smi's).
    """
    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


@contextlib.contextmanager
def board_samples(
    report: dict[str, object], *, gpu: str | None = None, period_ms: int = 200
) -> Iterator[None]:
    """Sample the board every ``period_ms`` while the block runs; summarise into ``report``.

    On exit ``report`` holds ``samples`` (how many), ``power_w_median``, ``power_w_range``,
    ``sm_mhz_median``, ``sm_mhz_range`` and the board's ``power_limit_w`` and ``sm_mhz_max``;
    or only ``note`` saying why there are none (no ``nvidia-smi``, or nothing readable: a
    field the board reports as ``[N/A]`` drops that sample). The block's own exceptions pass
    through, after the sampler is stopped and what it sampled is summarised.

    Args:
        report: filled in place (the caller's JSON row).
        gpu: the board as ``nvidia-smi -i`` takes it; None: torch's current CUDA device
            (:func:`smi_gpu_id`).
        period_ms: the sampling period.
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        report["note"] = "nvidia-smi not found: no power or clock samples"
        yield
        return
    command = [
        smi,
        f"--query-gpu={','.join(_QUERY)}",
        "--format=csv,noheader,nounits",
        "-lms",
        str(period_ms),
        "-i",
        smi_gpu_id(torch.cuda.current_device()) if gpu is None else gpu,
    ]
    # Into a file, not a pipe: nobody reads while the block runs, and a full pipe would stop
    # the sampling of a long block without a word.
    with (
        tempfile.TemporaryFile("w+") as samples,
        subprocess.Popen(command, stdout=samples, stderr=subprocess.DEVNULL, text=True) as sampler,
    ):
        try:
            yield
        finally:  # also when the block raised: what was sampled until then is reported
            sampler.terminate()
            try:
                sampler.wait(timeout=10)
            except subprocess.TimeoutExpired:  # it ignored the terminate
                sampler.kill()
                sampler.wait()
            samples.seek(0)
            report.update(summarise(samples.read()))


def summarise(csv_text: str) -> dict[str, object]:
    """The summary of ``nvidia-smi`` CSV lines of the four fields of :data:`_QUERY`."""
    rows = []
    for line in csv_text.splitlines():
        fields = line.split(",")
        if len(fields) != len(_QUERY):
            continue
        try:
            rows.append([float(x) for x in fields])
        except ValueError:  # "[N/A]" or a cut-off last line
            continue
    if not rows:
        return {"note": "nvidia-smi gave no readable samples"}
    power = [r[0] for r in rows]
    clock = [r[1] for r in rows]
    return {
        "samples": len(rows),
        "power_w_median": statistics.median(power),
        "power_w_range": [min(power), max(power)],
        "sm_mhz_median": statistics.median(clock),
        "sm_mhz_range": [min(clock), max(clock)],
        "power_limit_w": rows[0][2],
        "sm_mhz_max": rows[0][3],
    }
