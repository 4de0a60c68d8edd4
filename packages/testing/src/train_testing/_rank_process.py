"""What runs inside one rank of a :class:`~train_testing.RankPool`, and the environment it starts in.

A spawned rank joins the process group through the rendezvous file, then runs the functions the
pool sends until it is told to stop, answering each with its pickled value or its traceback.
SIGUSR1 dumps its stack into its stack file (how the pool shows where a blocked rank is stuck).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

__all__ = ["RANK_ENV", "rank_environment", "rank_main"]

# Environment every rank gets: one thread per rank on a 2-core machine, and loopback for gloo
# (hostname-based interface discovery is flaky on CI hosts).
RANK_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TORCH_SHOW_CPP_STACKTRACES": "0"}


def rank_main(
    rank: int,
    world_size: int,
    backend: str,
    init_file: str,
    pg_timeout_s: float,
    stack_file: str,
    tasks: Any,
    results: Any,
) -> None:
    """Entry point of one spawned rank: join the group, then run tasks until told to stop."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(stack_file, "w") as stack_out:
        # The parent sends SIGUSR1 to a blocked rank to learn where it is stuck.
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
        try:
            device_id = None
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
                device_id = torch.device("cuda", torch.cuda.current_device())
            dist.init_process_group(
                backend,
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
                device_id=device_id,
            )
        except BaseException:
            results.put((-1, rank, False, traceback.format_exc()))
            return
        results.put((-1, rank, True, None))
        while True:
            task = tasks.get()
            if task is None:
                break
            task_id, sys_path, payload = task
            # Test modules are importable only through the caller's sys.path (pytest's rootdir
            # insertion), so the rank adopts it before unpickling the function reference.
            for entry in reversed(sys_path):
                if entry not in sys.path:
                    sys.path.insert(0, entry)
            try:
                fn, args, kwargs = pickle.loads(payload)
                value = fn(rank, world_size, *args, **kwargs)
                results.put((task_id, rank, True, pickle.dumps(value)))
            except BaseException:
                results.put((task_id, rank, False, traceback.format_exc()))
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


@contextlib.contextmanager
def rank_environment() -> Iterator[None]:
    """Set the rank environment for the duration of a spawn (children copy os.environ)."""
    saved = {key: os.environ.get(key) for key in RANK_ENV}
    os.environ.update(RANK_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
