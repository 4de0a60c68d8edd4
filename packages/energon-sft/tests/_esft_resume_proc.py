"""Subprocess side of the kill-and-resume test (run as a script, not collected by pytest).

usage: python _esft_resume_proc.py victim|resume DATASET OUTDIR

victim: for every case, iterate N batches, save the loader state (fsync'd), take one more
    batch, then SIGKILL the whole process with all loaders and workers alive.
resume: in a fresh process, for every case: an uninterrupted reference run of N + M batches,
    a loader restored from the victim's state, and one restored from a state saved right after
    that restore; writes the batch digests as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _esft_data import batch_digest, build_processor

# (name, workers, shuffle buffer, batches before the save)
CASES = [
    ("w0_buf0", 0, 0, 3),
    ("w0_buf32", 0, 32, 3),
    ("w2_buf0", 2, 0, 3),
    ("w2_buf32", 2, 32, 3),
    ("w2_buf32_before_iter", 2, 32, 0),
]
M = 4


def _loader(ds: str, proc: Any, workers: int, buffer: int) -> Any:
    import torch  # noqa: F401

    from energon_sft import LoaderOptions, SFTTaskEncoder, build_sft_loader

    enc = SFTTaskEncoder(proc, model_family="qwen2_5_vl", max_length=512)
    return build_sft_loader(
        ds,
        encoder=enc,
        batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        num_workers=workers,
        seed=11,
        shuffle_buffer_size=buffer,
        options=LoaderOptions(checkpoint_every_sec=0.2, watchdog_timeout_seconds=None),
    )


def _take(it: Any, n: int) -> list[str]:
    return [batch_digest(next(it)) for _ in range(n)]


def victim(ds: str, out: Path, proc: Any) -> None:
    import torch

    live = []
    for name, workers, buffer, n in CASES:
        loader = _loader(ds, proc, workers, buffer)
        it = iter(loader)
        _take(it, n)
        path = out / f"{name}.pt"
        with path.open("wb") as fh:
            torch.save(loader.state_dict(), fh)
            fh.flush()
            os.fsync(fh.fileno())
        _take(it, 1)  # progress past the save, which the resume must not see
        live.append((loader, it))
    os.kill(os.getpid(), signal.SIGKILL)


def resume(ds: str, out: Path, proc: Any) -> None:
    import torch

    result = {}
    for name, workers, buffer, n in CASES:
        with _loader(ds, proc, workers, buffer) as ref_loader:
            reference = _take(iter(ref_loader), n + M)
        state = torch.load(out / f"{name}.pt", weights_only=True)
        restored = _loader(ds, proc, workers, buffer)
        restored.load_state_dict(state)
        resaved_state = restored.state_dict()  # right after a restore, before iterating
        resumed = _take(iter(restored), M)
        restored.close()
        with _loader(ds, proc, workers, buffer) as resaved:
            resaved.load_state_dict(resaved_state)
            again = _take(iter(resaved), M)
        result[name] = {"n": n, "reference": reference, "resumed": resumed, "resaved": again}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    mode, dataset, outdir = sys.argv[1:4]
    processor = build_processor()
    {"victim": victim, "resume": resume}[mode](dataset, Path(outdir), processor)
