"""The code one Ray actor runs: one rank of the job, torch.distributed inside it.

The actor is a plain class (``ray.remote`` wraps it in the driver), importable without Ray.
Each actor learns its rank at construction; rank 0 names the rendezvous (its node's address
and a free port), and every actor then joins the default process group through the same
environment torchrun would set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), so the recipe runs unchanged.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from train_recipes.config_sft import SFTConfig

__all__ = ["RankActor"]


class RankActor:
    """One rank of the job, in its own Ray worker process.

    Args:
        rank: global rank.
        world_size: ranks in the job.
        gpu: the actor holds one GPU (Ray sets ``CUDA_VISIBLE_DEVICES`` to it, so it is
            ``cuda:0`` here).
    """

    def __init__(self, *, rank: int, world_size: int, gpu: bool) -> None:
        self.rank = rank
        self.world_size = world_size
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        # Each actor sees its own device only: cuda:0 for a GPU bundle, no GPU for a CPU one.
        os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"
        if not gpu:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read at CUDA's first use, later
            # CPU ranks: split the node's cores between the ranks instead of oversubscribing.
            threads = max(1, (os.cpu_count() or 1) // world_size)
            os.environ.setdefault("OMP_NUM_THREADS", str(threads))
            import torch

            torch.set_num_threads(threads)

    def pid(self) -> int:
        """This actor's process id (the tests SIGKILL it)."""
        return os.getpid()

    def endpoint(self) -> tuple[str, int]:
        """The rendezvous rank 0 offers: this node's address and a free TCP port."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return host, port

    def run_sft(self, config: SFTConfig, resume: bool, master: tuple[str, int]) -> dict[str, Any]:
        """Join the process group at ``master`` and run the SFT recipe as this rank.

        Returns:
            The run's summary (plain data): steps, first and last loss, accuracies, this
            rank's data plane and the loaders it built.
        """
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
        from train_recipes.sft import run_sft

        result = run_sft(config, resume=resume)
        return {
            "rank": self.rank,
            "steps": result.steps,
            "first_loss": result.first_loss,
            "last_loss": result.last_loss,
            "accuracy_before": result.accuracy_before,
            "accuracy_after": result.accuracy_after,
            "export_dir": None if result.export_dir is None else str(result.export_dir),
            "data_plane": None if result.data_plane is None else result.data_plane.state_dict(),
            "loaders_built": result.loaders_built,
        }
