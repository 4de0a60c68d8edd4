"""What the ranks of test_preemption.py run (spawned by the rank_pool fixture)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any


def stop_by_a_signal_to_rank0(
    rank: int, world_size: int, overrides: list[str], signum: int, after_rows: int
) -> dict[str, Any]:
    """Run SFT with a trap on every rank; rank 0 alone signals itself once its metrics file
    holds ``after_rows`` rows. Returns what this rank's RunStopped says (empty: no stop)."""
    from train_recipes.config import SFTConfig, load_config, validate_sft
    from train_recipes.run.preemption import RunStopped, SignalTrap
    from train_recipes.sft.run import run_sft

    config = load_config(SFTConfig, None, overrides)
    validate_sft(config, world_size=world_size)
    out = Path(config.train.output_dir)
    done = threading.Event()

    def signal_rank0() -> None:
        metrics = out / "metrics.jsonl"
        while not done.wait(0.01):
            if metrics.is_file() and metrics.read_text().count("\n") >= after_rows:
                os.kill(os.getpid(), signum)
                return

    thread = threading.Thread(target=signal_rank0, daemon=True)
    with SignalTrap(output_dir=out, checkpoint=True, grace_s=None, say=False) as trap:
        if rank == 0:
            thread.start()
        try:
            run_sft(config, signals=trap)
        except RunStopped as stop:
            return {
                "step": stop.step,
                "signum": stop.signum,
                "checkpoint": stop.checkpoint,
                "exit_code": stop.exit_code,
                "received": trap.received,
                "message": str(stop),
            }
        finally:
            # Never signal this (pooled) process after its trap is gone.
            done.set()
            if thread.is_alive():
                thread.join()
    return {}  # the run finished before the signal
