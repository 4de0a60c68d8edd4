"""The driver of ``train-recipes sft --controller ray``.

It places one actor per rank, runs the training loop and reports a failed or dead rank in one
line, within seconds, without hanging. SIGTERM or SIGINT to the driver stops the actors at the
next step boundary with a checkpoint of that step (:mod:`train_recipes.run.preemption`).

The driver holds no model. It hosts the job's rendezvous store, as torchrun's agent does, so
the store outlives every rank: a rank's hang watchdog leaves its verdict there before it ends
its own (healthy) actor, and the driver's last line names the rank the verdict names, not the
first actor that exited. Each actor joins the job's process group (gloo on CPU, NCCL on GPU)
and holds its rank's ``SFTRecipe``; the driver runs the recipes' one loop
(``train_recipes.loop.drive.drive``: step accounting, when to evaluate and checkpoint, metrics.jsonl,
TensorBoard, the progress bar, the summary) and calls each stage on every actor. The records
of a stage are agreed over the ranks inside it, so rank 0's is logged. Every step's sample ids
come back from every rank into the driver's data plane, which checks that the cp/tp peers of
each replica trained on the same samples.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from train_recipes.config.sft import SFTConfig
from train_recipes.controller.ray_cluster import (
    ActorFailure,
    RankGroup,
    first_line,
    import_ray,
    plan_placement,
    start_or_join,
)
from train_recipes.data.plane import DataPlane, PlaneMismatchError
from train_recipes.loop.drive import drive
from train_recipes.loop.hang_watchdog import hang_report
from train_recipes.loop.records import RunEnd, RunStart, StepRecord
from train_recipes.run.preemption import RunStopped, SignalTrap, stopped_error
from train_recipes.sft.summary import sft_summary_text

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from train_recipes.controller.rank_actor import CloseReport, SetupReport, StepReport

# How long the actors may take to come up and answer their first call (imports of torch and
# transformers on a loaded node take tens of seconds).
_START_TIMEOUT_S = 300.0

__all__ = ["ControllerError", "RayRun", "failure_line", "main_on_ray", "run_sft_on_ray"]

logger = logging.getLogger(__name__)


class ControllerError(RuntimeError):
    """The Ray job failed (a rank died or raised, or the cluster cannot place it): one line."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RayRun:
    """What a finished Ray job reports.

    Attributes:
        steps: optimizer steps done in total.
        first_loss: the first logged loss of the run (also across resumes).
        last_loss: the loss of the last step.
        accuracy_before: held-out exact match before training (None when not measured).
        accuracy_after: held-out exact match after training.
        data_plane: the samples every replica trained on, per step.
        loaders_built: energon-sft loaders each rank built, in rank order.
        placed_on_gpus: the ranks held one GPU each (else one CPU each).
        ranks: every rank's own report, in rank order.
    """

    steps: int
    first_loss: float | None
    last_loss: float | None
    accuracy_before: float | None
    accuracy_after: float | None
    data_plane: DataPlane
    loaders_built: list[int]
    placed_on_gpus: bool
    ranks: list[CloseReport] = field(default_factory=list)


def run_sft_on_ray(
    config: SFTConfig,
    *,
    world_size: int,
    resume: bool = False,
    address: str | None = None,
    signals: SignalTrap | None = None,
) -> RayRun:
    """Run the SFT job on ``world_size`` Ray actors.

    Uses the Ray cluster this process is connected to, else joins ``address`` ("auto" finds a
    local ``ray start`` cluster), else starts a local one for the job (and stops it after).

    Args:
        config: a validated config (``validate_sft`` with this world size).
        world_size: ranks (actors) of the job: dp x cp x tp.
        resume: continue from the newest complete checkpoint (as ``--resume``).
        address: a Ray cluster to join.
        signals: a trap this process enters once Ray is up (ray.init installs Ray's own
            SIGTERM handler, which aborts); a signal it records stops the job at the next step
            boundary, with a checkpoint (this process decides for every actor).

    Raises:
        ControllerError: a rank died or raised (the message names it), or the cluster has no
            room for the job. The other ranks are stopped first.
        RunStopped: after the checkpoint of the step a signal stopped the job at.
    """
    ray = import_ray()
    try:
        started = start_or_join(ray, address=address, world_size=world_size)
    except Exception as err:  # Ray raises plain Exceptions for a cluster that does not come up
        where = f"join the Ray cluster at {address!r}" if address else "start a local Ray cluster"
        raise ControllerError(f"could not {where}: {first_line(err)}") from None
    dp = world_size // (config.parallel.cp * config.parallel.tp)
    plane = DataPlane(dp_size=dp)
    group: RankGroup | None = None
    trapped = contextlib.ExitStack()
    store, master = _host_store(ray)
    try:
        if signals is not None:
            trapped.enter_context(signals)
        from train_recipes.controller.rank_actor import RankActor

        placement = plan_placement(ray, world_size=world_size, device=config.train.device)
        group = RankGroup(ray, RankActor, placement=placement)
        # The first call waits for the actors to come up: bounded, so that workers that die at
        # start (before any actor exists to be reported dead) cannot hang the driver.
        group.call("pid", timeout_s=_START_TIMEOUT_S)
        setups: list[SetupReport] = group.call("setup", config, resume, master)
        restored = DataPlane(dp_size=dp)
        restored.load_state_dict([s["plane"] for s in setups])  # the checkpoint's records
        plane.merge(restored)
        start: RunStart = setups[0]["start"]
        outcome = drive(
            _ActorStages(group, plane),
            start,
            is_main=True,
            format_summary=sft_summary_text,
            stop_vote=None if signals is None else lambda _step: signals.received,
        )
        reports: list[CloseReport] = group.call("close")
    except ActorFailure as err:
        raise ControllerError(
            failure_line(err, hang_report(store, world_size=world_size))
        ) from None
    except PlaneMismatchError as err:
        raise ControllerError(
            f"the ranks of a replica trained on different samples: {err}"
        ) from None
    except RuntimeError as err:  # placement: no room, no GPUs
        raise ControllerError(str(err)) from None
    finally:
        trapped.close()
        if group is not None:
            group.shutdown()
        if started:
            ray.shutdown()
    if outcome.stopped is not None:
        raise stopped_error(outcome.stopped, config.train.output_dir)
    summary = {} if outcome.end is None else outcome.end.summary
    return RayRun(
        steps=int(summary.get("steps", start.start_step)),
        first_loss=summary.get("first_loss"),
        last_loss=summary.get("last_loss"),
        accuracy_before=summary.get("accuracy_before"),
        accuracy_after=summary.get("accuracy_after"),
        data_plane=plane,
        loaders_built=[int(r["loaders_built"]) for r in reports],
        placed_on_gpus=placement.use_gpus,
        ranks=reports,
    )


def failure_line(failure: ActorFailure, verdict: str | None) -> str:
    """The driver's one line for a job whose rank died or raised.

    A rank whose hang watchdog fires is the healthy one, waiting for a peer that stopped: it
    ends its own actor, which is then often the first the driver sees exit. So the watchdog's
    verdict (:func:`train_recipes.loop.hang_watchdog.hang_report`), naming the ranks that
    stopped or fell behind, is the line; the first failed actor only when no watchdog fired.

    Args:
        failure: the first rank that died or raised, as the driver saw it.
        verdict: the watchdog's message, or None.
    """
    cause = str(failure) if verdict is None else verdict
    return (
        f"{cause}; the other ranks were stopped. Continue from the last checkpoint with the same "
        "command and --resume"
    )


def _host_store(ray: ModuleType) -> tuple[TCPStore, tuple[str, int]]:
    """The job's rendezvous store, served by this process; and its address for the actors.

    The actors join it as torchrun's ranks join their agent's store (``rank_actor``), so it
    does not end with rank 0 and the watchdog's verdict in it can be read after any rank died.
    """
    from torch.distributed import TCPStore

    host = str(ray.util.get_node_ip_address())
    # Port 0: the system picks a free one. The timeout bounds only this process's own reads.
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=1))
    return store, (host, int(store.port))


class _ActorStages:
    """The loop's stages (``loop.RecipeStages``) called on every actor; rank 0's record back.

    Each step's sample ids, reported by every rank, go into the driver's data plane.
    """

    def __init__(self, group: RankGroup, plane: DataPlane) -> None:
        self._group = group
        self._plane = plane

    def setup(self) -> RunStart:
        raise RuntimeError("the driver runs setup on the actors itself (it needs the rendezvous)")

    def train_step(self, step: int) -> StepRecord:
        reports: list[StepReport] = self._group.call("train_step", step)
        for report in reports:
            self._plane.record(step, report["replica"], report["sample_ids"])
        record: StepRecord = reports[0]["record"]
        return record

    def evaluate(self, step: int) -> StepRecord:
        record: StepRecord = self._group.call("evaluate", step)[0]
        return record

    def checkpoint(self, step: int) -> None:
        self._group.call("checkpoint", step)

    def finish(self) -> RunEnd:
        end: RunEnd = self._group.call("finish")[0]
        return end


def main_on_ray(config: object, *, world_size: int, resume: bool, address: str | None) -> int:
    """``train-recipes sft --controller ray``: run the job, one line on failure; exit status."""
    assert isinstance(config, SFTConfig)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    train = config.train
    trap = SignalTrap(
        output_dir=Path(train.output_dir),
        checkpoint=train.checkpoint_on_signal,
        grace_s=train.signal_grace_s,
        say=True,
    )
    try:
        run = run_sft_on_ray(
            config, world_size=world_size, resume=resume, address=address, signals=trap
        )
    except (ControllerError, RunStopped) as err:
        print(f"train-recipes sft: {err}", file=sys.stderr, flush=True)
        return err.exit_code if isinstance(err, RunStopped) else 1
    where = "GPU" if run.placed_on_gpus else "CPU"
    print(
        f"train-recipes sft: {len(run.loaders_built)} Ray actors (one {where} each) finished "
        f"step {run.steps}; {sum(run.loaders_built)} loader(s), one per dp replica",
        flush=True,
    )
    return 0
