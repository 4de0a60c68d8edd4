"""Ray's side of the controller.

The lazy import, the cluster (started here or joined), the placement group and one actor per
rank, and calls on all actors that fail fast.

A call on the actors waits with ``ray.wait`` in short slices: the first actor that dies or
raises ends the call at once (its error names the rank), the other actors are killed, and the
driver never waits on a rank that cannot answer.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from train_recipes.config.extras import install_hint

if TYPE_CHECKING:
    from ray import ObjectRef

__all__ = [
    "RAY_EXTRA",
    "ActorFailure",
    "RankGroup",
    "first_line",
    "import_ray",
    "start_or_join",
]

logger = logging.getLogger(__name__)

#: The extra that installs Ray (named in every error about it).
RAY_EXTRA = "ray"
# How long a call waits between checks of its actors (seconds).
_POLL_S = 0.5
# After a rank fails, how long its peers' failures are awaited to find a dead actor (seconds).
_GRACE_S = 5.0


def import_ray() -> ModuleType:
    """``import ray``, or an ImportError naming the extra that installs it.

    Ray's ``uv run`` integration is turned off first (unless the user set it): it would ship
    the working directory to every worker and build a second environment there, while the
    actors of this job run the driver's own interpreter and packages.
    """
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    _temp_dir_outside_virtualenv()
    try:
        import ray
    except ImportError as err:
        raise ImportError(
            f"--controller ray needs the 'ray' package, which is not installed; "
            f"{install_hint(RAY_EXTRA)}"
        ) from err
    return ray


def _temp_dir_outside_virtualenv() -> None:
    """Point Ray's temp dir out of the active virtualenv when the default lies inside it.

    Ray's workers refuse a temp dir under ``$VIRTUAL_ENV`` ("temp_dir must not be child
    directory of virtualenv root") and die at start, so their actors never come up; a session
    runner that sets ``TMPDIR`` inside the environment (nox does) triggers it. ``RAY_TMPDIR``
    set by the user is kept.
    """
    venv = os.environ.get("VIRTUAL_ENV")
    if "RAY_TMPDIR" in os.environ or not venv:
        return
    fallback = os.path.join(os.sep, "tmp")  # Ray's own default without TMPDIR
    default = os.environ.get("TMPDIR", fallback)
    if Path(default).resolve().is_relative_to(Path(venv).resolve()):
        os.environ["RAY_TMPDIR"] = fallback


class ActorFailure(RuntimeError):
    """A rank's actor died or raised during a call; the message names the rank."""

    def __init__(self, message: str, *, rank: int, died: bool) -> None:
        super().__init__(message)
        self.rank = rank
        self.died = died


def start_or_join(ray: ModuleType, *, address: str | None, world_size: int) -> bool:
    """Join the cluster at ``address``, or start a local one for this job.

    ``address="auto"`` is the local ``ray start`` cluster. Without an address the job always
    starts its own cluster (Ray's ``address="local"``) with at least ``world_size`` CPUs
    (logical: one bundle per rank): a bare ``ray.init()`` would instead join whatever cluster
    ``RAY_ADDRESS`` or Ray's session file names, a live ``ray start`` cluster or the stale
    file of one stopped abnormally, and then refuse ``num_cpus``. Joining stays explicit.

    Returns:
        Whether this call connected (False when Ray was already initialised, e.g. by a test).
    """
    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        cpus = max(os.cpu_count() or 1, world_size)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    return True


@dataclass(kw_only=True, slots=True, frozen=True)
class Placement:
    """Where the ranks go.

    Attributes:
        world_size: ranks (actors).
        use_gpus: one GPU per rank (else one CPU per rank).
    """

    world_size: int
    use_gpus: bool


def plan_placement(ray: ModuleType, *, world_size: int, device: str) -> Placement:
    """Choose the bundles: GPU for ``train.device=cuda``, CPU otherwise.

    ``train.device=auto`` takes GPU bundles when the cluster has a GPU per rank.

    Raises:
        RuntimeError: ``train.device=cuda`` on a cluster with fewer GPUs than ranks.
    """
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if device == "cuda" and gpus < world_size:
        raise RuntimeError(
            f"train.device=cuda with {world_size} ranks but the Ray cluster has {gpus} GPUs; "
            "add GPU nodes (ray start --address ...) or start fewer ranks"
        )
    return Placement(world_size=world_size, use_gpus=device != "cpu" and gpus >= world_size)


class RankGroup:
    """One actor per rank, each in its own placement-group bundle (PACK: as few nodes as fit).

    Args:
        ray: the imported module.
        actor_class: the class each actor runs (``rank_actor.RankActor``).
        placement: bundle kind and count.
        ready_timeout_s: the longest wait for the bundles (a cluster without room for the job).
    """

    def __init__(
        self,
        ray: ModuleType,
        actor_class: type,
        *,
        placement: Placement,
        ready_timeout_s: float = 120.0,
    ) -> None:
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove = remove_placement_group
        bundle = {"GPU": 1, "CPU": 1} if placement.use_gpus else {"CPU": 1}
        self._group = placement_group([dict(bundle)] * placement.world_size, strategy="PACK")
        ready, _ = ray.wait([self._group.ready()], timeout=ready_timeout_s)
        if not ready:
            self._remove(self._group)
            raise RuntimeError(
                f"the Ray cluster has no room for {placement.world_size} bundles of {bundle} "
                f"after {ready_timeout_s:.0f} s (ray.cluster_resources(): "
                f"{ray.cluster_resources()}); start fewer ranks or add nodes"
            )
        remote = ray.remote(actor_class)
        self.actors = [
            remote.options(
                num_cpus=1,
                num_gpus=1 if placement.use_gpus else 0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank
                ),
            ).remote(rank=rank, world_size=placement.world_size, gpu=placement.use_gpus)
            for rank in range(placement.world_size)
        ]

    def call(
        self,
        method: str,
        *args: object,
        ranks: Sequence[int] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:  # the method's results: a call by name is not typed
        """``actor.method(*args)`` on every rank (or ``ranks``); the results in rank order.

        Raises:
            ActorFailure: the first rank that died or raised (the others are not awaited).
        """
        chosen = list(range(len(self.actors))) if ranks is None else list(ranks)
        refs = [getattr(self.actors[r], method).remote(*args) for r in chosen]
        return self.wait(refs, chosen, what=method, timeout_s=timeout_s)

    def wait(
        self,
        refs: list[ObjectRef[object]],
        ranks: list[int],
        *,
        what: str,
        timeout_s: float | None = None,
    ) -> list[object]:
        """Results of ``refs`` (one per rank of ``ranks``); fails on the first bad one.

        When a rank dies, its peers fail soon after in a collective with it; the death is the
        cause, so the failures of a short grace period are compared and a dead actor named
        first.
        """
        ray = self._ray
        rank_of = {ref: rank for ref, rank in zip(refs, ranks, strict=True)}
        results: dict[int, object] = {}
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                late = sorted(rank_of[ref] for ref in pending)
                raise ActorFailure(
                    f"rank(s) {late} did not answer {what} within {timeout_s:.0f} s (an actor "
                    "whose worker process crashed at start never comes up; see Ray's logs in "
                    "its session folder)",
                    rank=late[0],
                    died=True,
                )
            ready, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            for ref in ready:
                failure = self._outcome(ref, rank_of[ref], what, results)
                if failure is None:
                    continue
                if not failure.died and pending:
                    more, _ = ray.wait(pending, num_returns=len(pending), timeout=_GRACE_S)
                    for other in more:
                        found = self._outcome(other, rank_of[other], what, results)
                        if found is not None and found.died:
                            raise found from None
                raise failure from None
        return [results[r] for r in ranks]

    def _outcome(
        self, ref: ObjectRef[object], rank: int, what: str, results: dict[int, object]
    ) -> ActorFailure | None:
        """Store the result of a finished call, or return its failure."""
        ray = self._ray
        try:
            results[rank] = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            return ActorFailure(
                f"rank {rank}'s actor died during {what} ({first_line(err)})", rank=rank, died=True
            )
        except ray.exceptions.RayTaskError as err:
            cause = err.as_instanceof_cause()
            return ActorFailure(
                f"rank {rank} failed during {what}: {type(cause).__name__}: {first_line(cause)}",
                rank=rank,
                died=False,
            )
        return None

    def shutdown(self) -> None:
        """Kill every actor and free the bundles.

        A rank blocked in a collective with a dead peer never returns, so none is waited for.
        """
        for actor in self.actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception as err:  # already gone
                logger.debug("kill: %s", err)
        # Give the raylet a moment to reap the workers before the bundles go away.
        time.sleep(0.1)
        try:
            self._remove(self._group)
        except Exception as err:
            logger.debug("remove_placement_group: %s", err)


def first_line(err: BaseException) -> str:
    """The line of an error worth printing (Ray wraps errors in headers and tracebacks)."""
    text = str(err).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    # Ray prefixes its own headers; the last line of a traceback is the error itself.
    return lines[-1].strip() if "Traceback" in text else lines[0].strip()
