"""Process-group start-up for the recipes: gloo on CPU, NCCL on CUDA, one (dp, cp) mesh."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class RankContext:
    """Where this process sits in the job.

    Attributes:
        rank: global rank.
        world_size: number of ranks (dp * cp).
        device: this rank's device.
        mesh: 3-D mesh ("dp", "cp", "tp"), tp innermost.
        dp_rank: index of this rank's data-parallel replica.
        dp_size: number of data-parallel replicas.
        cp_size: context-parallel degree.
        tp_size: tensor-parallel degree (of the output projection).
    """

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    dp_rank: int
    dp_size: int
    cp_size: int
    tp_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints and writes shared files."""
        return self.rank == 0

    def grad_mesh(self) -> DeviceMesh:
        """The mesh gradients are averaged over: every rank holding a distinct part of the batch."""
        if self.cp_size == 1:
            return self.mesh["dp"]
        return self.mesh["dp", "cp"]._flatten("dp_cp")


def pick_device(preference: str, *, local_world_size: int | None = None) -> torch.device:
    """Resolve train.device: "auto" picks CUDA when every local rank gets its own GPU.

    The choice depends only on the node (GPU count vs local world size), so all ranks of a
    node agree and never mix NCCL and gloo.

    Args:
        preference: "auto", "cpu" or "cuda".
        local_world_size: ranks on this node; None reads LOCAL_WORLD_SIZE (the launcher's).
            The CLI passes ``--nproc-per-node`` to plan the device before launching.
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = (
        int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world_size is None
        else local_world_size
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if preference == "cuda":
        if gpus < local_world:
            raise RuntimeError(
                f"train.device='cuda' with {local_world} local ranks but {gpus} CUDA devices; "
                "start one rank per GPU or use train.device=cpu"
            )
        return torch.device("cuda", local)
    if preference == "auto" and gpus >= local_world:
        return torch.device("cuda", local)
    return torch.device("cpu")


def process_group_timeout_s(collective_timeout_s: float) -> float:
    """The process group's own timeout for ``train.collective_timeout_s``: a backstop.

    The recipe's hang watchdog (``train_recipes.loop.hang_watchdog``) enforces
    ``collective_timeout_s`` and names the missing ranks; the group's timeout, which names none
    and cannot be changed once the group exists, is set a little later so that the watchdog
    reports first.
    """
    return collective_timeout_s + max(5.0, 0.1 * collective_timeout_s)


def describe_device(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200, nccl)`` or ``cpu (gloo)``: for the run's header and summary."""
    backend = dist.get_backend() if dist.is_initialized() else "none"
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)}, {backend})"
    return f"{device} ({backend})"


def init_distributed(
    *, device_preference: str, cp: int, tp: int = 1, timeout_s: float = 600.0
) -> RankContext:
    """Join (or create, for one process) the default process group and build the (dp, cp) mesh.

    Works under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) and as a plain single process, where a
    one-rank group on a local file store is created so the same code path runs everywhere.
    ``timeout_s`` is the group's collective timeout (see :func:`process_group_timeout_s`); it
    applies only when this call creates the group.
    """
    device = pick_device(device_preference)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(
                backend,
                timeout=timedelta(seconds=timeout_s),
                device_id=device if device.type == "cuda" else None,
            )
        else:
            store = dist.HashStore()
            dist.init_process_group(
                backend,
                store=store,
                rank=0,
                world_size=1,
                timeout=timedelta(seconds=timeout_s),
                # Bound to the device: NCCL's barrier otherwise warns that it guesses it.
                device_id=device if device.type == "cuda" else None,
            )
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world % (cp * tp):
        raise ValueError(f"parallel.cp*tp={cp * tp} does not divide the world size {world}")
    dp = world // (cp * tp)
    mesh = init_device_mesh(device.type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    return RankContext(
        rank=rank,
        world_size=world,
        device=device,
        mesh=mesh,
        dp_rank=mesh.get_local_rank("dp"),
        dp_size=dp,
        cp_size=cp,
        tp_size=tp,
    )


def close_process_group() -> None:
    """Destroy the default process group after a run that ended normally, if one exists.

    NCCL warns at exit about a group left open; a failed run skips this, since destroying a
    group whose peers died can block.
    """
    if dist.is_initialized():
        dist.destroy_process_group()


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(*, poll_s: float = 0.5) -> None:
    """End this process (SIGKILL) as soon as the process that started it ends.

    A rank started by a launcher (torch's elastic agent, torchrun) must not outlive it: an
    orphaned rank keeps training and writing checkpoints beside the next job. On Linux the
    kernel delivers the signal (``prctl(PR_SET_PDEATHSIG)``, also when the launcher is
    SIGKILLed); elsewhere a daemon thread polls the parent PID every ``poll_s`` seconds.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
        if armed:
            if os.getppid() != parent:  # the launcher ended before the signal was armed
                os.kill(os.getpid(), signal.SIGKILL)
            return
        logger.warning("prctl(PR_SET_PDEATHSIG) failed; watching the launcher's PID instead")

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
