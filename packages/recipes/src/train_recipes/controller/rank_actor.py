"""The code one Ray actor runs: one rank of the job, torch.distributed inside it.

The actor is a plain class (``ray.remote`` wraps it in the driver), importable without Ray.
Each actor learns its rank at construction and joins the default process group through the
same environment torchrun would set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_USE_AGENT_STORE``): the store at
``MASTER_ADDR:MASTER_PORT`` is the driver's, as under torchrun it is the agent's, so every rank
is its client and the store outlives them all. The actor holds the rank's ``SFTRecipe`` and runs its
stages when the driver calls them; the driver runs the loop.

What the controller costs shows in the run's own metrics: each logged step's record from rank
0 carries ``controller/wait_ms`` (the mean time this actor waited between the end of one
``train_step`` call, or of an evaluation or checkpoint the driver ran between them, and the
start of the next: the driver's round trip, its logging and Ray's call overhead) and ``controller/step_ms`` (the mean time inside ``train_step``), both averaged
over the steps since the previous logged record.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TypedDict

from train_recipes.config.loader import JSONValue
from train_recipes.config.sft import SFTConfig
from train_recipes.loop.records import RunEnd, RunStart, StepRecord

__all__ = ["CloseReport", "RankActor", "SetupReport", "StepReport"]


class SetupReport(TypedDict):
    """:meth:`RankActor.setup`'s answer: the recipe's RunStart, its data plane and replica."""

    start: RunStart
    plane: dict[str, JSONValue]
    replica: int


class StepReport(TypedDict):
    """:meth:`RankActor.train_step`'s answer: the record and the samples the replica trained."""

    record: StepRecord
    replica: int
    sample_ids: list[str]


class CloseReport(TypedDict):
    """:meth:`RankActor.close`'s answer: the rank's data plane and the loaders it built."""

    rank: int
    data_plane: dict[str, JSONValue]
    loaders_built: int


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
        self._clock = _StepClock()
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
        """This actor's process id (the driver's first call, to know the actor is up)."""
        return os.getpid()

    def setup(self, config: SFTConfig, resume: bool, master: tuple[str, int]) -> SetupReport:
        """Join the process group on the driver's store at ``master``; the recipe's ``setup()``.

        Returns:
            ``start`` (the recipe's RunStart), this rank's restored data plane (``plane``)
            and its replica (``replica``).
        """
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
        # torch.distributed then connects to that store as a client instead of rank 0 serving
        # one (which would end with rank 0, and the hang watchdog's verdict in it).
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")  # older torch reads it then
        from train_recipes.sft.recipe import SFTRecipe

        self.recipe = SFTRecipe(config, resume=resume).__enter__()
        start = self.recipe.setup()
        return {
            "start": start,
            "plane": self.recipe.data_plane.state_dict(),
            "replica": self.recipe.ctx.dp_rank,
        }

    def train_step(self, step: int) -> StepReport:
        """One optimizer step: the recipe's record and the ids of the samples it trained on."""
        self._clock.begin()
        record = self.recipe.train_step(step)
        self._clock.end()
        if record.metrics:
            record = dataclasses.replace(record, metrics={**record.metrics, **self._clock.read()})
        replica = self.recipe.ctx.dp_rank
        ids = self.recipe.data_plane.list_sample_ids(step, replica=replica)
        return {"record": record, "replica": replica, "sample_ids": ids}

    def evaluate(self, step: int) -> StepRecord:
        """The recipe's evaluations due at ``step``."""
        record = self.recipe.evaluate(step)
        self._clock.other_call_ended()
        return record

    def checkpoint(self, step: int) -> None:
        """Save a checkpoint of ``step`` (collective over the actors)."""
        self.recipe.checkpoint(step)
        self._clock.other_call_ended()

    def finish(self) -> RunEnd:
        """Final evaluation and export; the summary."""
        return self.recipe.finish()

    def close(self) -> CloseReport:
        """End the run on this rank (after every rank finished): its plane and loader count."""
        import torch.distributed as dist

        recipe = self.recipe
        dist.barrier()
        recipe.__exit__(None, None, None)
        return {
            "rank": self.rank,
            "data_plane": recipe.data_plane.state_dict(),
            "loaders_built": recipe.loader.loaders_built,
        }


class _StepClock:
    """Time inside ``train_step`` calls and between them, averaged since the last read."""

    def __init__(self) -> None:
        self._last_end: float | None = None
        self._began = 0.0
        self._busy_s = self._wait_s = 0.0
        self._steps = self._waits = 0

    def begin(self) -> None:
        self._began = time.perf_counter()
        if self._last_end is not None:  # the first step follows setup, not the driver's loop
            self._wait_s += self._began - self._last_end
            self._waits += 1

    def end(self) -> None:
        self._last_end = time.perf_counter()
        self._busy_s += self._last_end - self._began
        self._steps += 1

    def other_call_ended(self) -> None:
        """A stage other than a step ended: the wait for the next step starts now, not earlier."""
        if self._last_end is not None:
            self._last_end = time.perf_counter()

    def read(self) -> dict[str, float]:
        """``controller/step_ms`` and ``controller/wait_ms`` (when measured), then reset."""
        out = {"controller/step_ms": 1000 * self._busy_s / max(self._steps, 1)}
        if self._waits:
            out["controller/wait_ms"] = 1000 * self._wait_s / self._waits
        self._busy_s = self._wait_s = 0.0
        self._steps = self._waits = 0
        return out
