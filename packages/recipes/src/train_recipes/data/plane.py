"""The local data plane: which samples trained at which step, with per-sample provenance.

Every batch the recipe trains on carries the ids of its samples (energon-sft's ``source_ids``:
a row's ``id``, else Energon's source key). The plane records them per optimizer step and per
data-parallel replica, answers :meth:`DataPlane.list_sample_ids`, and its state travels in the
checkpoint (the Engine's per-rank extra state, written to ``step_N.tmp`` and swapped in whole, so
a save that fails part way leaves the previous checkpoint and its plane loadable).

Process-local: under SPMD each replica's loader rank records its own replica; the Ray driver
merges what the actors report into one plane of every replica (:meth:`DataPlane.merge`). Pure
bookkeeping, no process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

from train_recipes.config.loader import JSONValue

if TYPE_CHECKING:
    from energon_sft import SFTBatch

__all__ = ["DataPlane", "PlaneMismatchError", "sample_ids_of"]

_FORMAT = 1


class PlaneMismatchError(ValueError):
    """Two reports of one (step, replica) disagree, or a state is not a data plane's."""


def sample_ids_of(batch: SFTBatch | Mapping[str, object]) -> list[str]:
    """The sample ids of an energon-sft batch (``source_ids``), in the batch's sample order.

    Raises:
        ValueError: the batch carries no ``source_ids`` (not an energon-sft batch).
    """
    ids = cast(
        "Sequence[object] | None",
        batch.get("source_ids")
        if isinstance(batch, Mapping)
        else getattr(batch, "source_ids", None),
    )
    if ids is None:
        raise ValueError(
            f"the batch ({type(batch).__name__}) has no source_ids; the data plane records "
            "energon-sft batches (SFTBatch.source_ids), build the loader with energon-sft"
        )
    return [str(i) for i in ids]


class DataPlane:
    """Sample ids per optimizer step and data-parallel replica.

    Args:
        dp_size: data-parallel replicas of the job.
    """

    def __init__(self, *, dp_size: int) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size={dp_size} must be >= 1")
        self.dp_size = dp_size
        self._steps: dict[int, dict[int, list[str]]] = {}

    def record(self, step: int, replica: int, sample_ids: Sequence[str]) -> None:
        """Record the samples ``replica`` trained on at ``step`` (all its micro-batches, in order).

        Recording the same (step, replica) again is allowed when the ids are equal (the cp/tp
        peers of a replica report the batch they received from its loader rank).

        Raises:
            ValueError: ``replica`` out of range or ``step`` < 1.
            PlaneMismatchError: a second report of (step, replica) with other ids: peers of one
                replica trained on different samples.
        """
        if not 0 <= replica < self.dp_size:
            raise ValueError(f"replica={replica} is not in [0, dp_size={self.dp_size})")
        if step < 1:
            raise ValueError(f"step={step} must be >= 1 (optimizer steps count from 1)")
        ids = [str(i) for i in sample_ids]
        known = self._steps.setdefault(step, {}).get(replica)
        if known is not None and known != ids:
            raise PlaneMismatchError(
                f"step {step}, replica {replica}: two ranks report different samples "
                f"({known[:3]}... vs {ids[:3]}...); the cp/tp peers of a replica must train on "
                "the batch its loader rank broadcast"
            )
        self._steps[step][replica] = ids

    def steps(self) -> list[int]:
        """The recorded steps, ascending."""
        return sorted(self._steps)

    def list_sample_ids(self, step: int, *, replica: int | None = None) -> list[str]:
        """The samples that trained at ``step``: replica 0's, then replica 1's, ...

        Args:
            step: an optimizer step.
            replica: only this replica's samples.

        Raises:
            KeyError: nothing recorded for ``step`` (or for ``replica`` at it).
        """
        if step not in self._steps:
            known = self.steps()
            span = f"steps {known[0]}..{known[-1]}" if known else "no step yet"
            raise KeyError(f"no samples recorded for step {step} (the plane holds {span})")
        by_replica = self._steps[step]
        if replica is not None:
            if replica not in by_replica:
                raise KeyError(f"step {step}: nothing recorded for replica {replica}")
            return list(by_replica[replica])
        return [i for r in sorted(by_replica) for i in by_replica[r]]

    def truncate(self, step: int) -> None:
        """Forget the steps after ``step`` (a resume from ``step`` redoes them)."""
        for s in [s for s in self._steps if s > step]:
            del self._steps[s]

    def merge(self, other: DataPlane) -> None:
        """Take every record of ``other`` (e.g. one replica's plane) into this one."""
        for step, by_replica in other._steps.items():
            for replica, ids in by_replica.items():
                self.record(step, replica, ids)

    def state_dict(self) -> dict[str, JSONValue]:
        """Plain data (ints, strings, lists): what a checkpoint stores."""
        return {
            "format": _FORMAT,
            "dp_size": self.dp_size,
            "steps": [
                [step, [[r, list(ids)] for r, ids in sorted(by_replica.items())]]
                for step, by_replica in sorted(self._steps.items())
            ],
        }

    def load_state_dict(self, state: Mapping[str, object] | Iterable[Mapping[str, object]]) -> None:
        """Replace the records by a saved state, or by the union of several (all old ranks').

        A job resumed on another dp size keeps the old records as they were (their replica
        indices are the saved job's); steps recorded from then on use the new layout.

        Raises:
            PlaneMismatchError: not a data plane state, or two states disagree.
        """
        states = [state] if isinstance(state, Mapping) else list(state)
        self._steps = {}
        for one in states:
            if not isinstance(one, Mapping) or one.get("format") != _FORMAT:
                raise PlaneMismatchError(
                    f"not a data plane state (format {_FORMAT} expected): {str(one)[:80]}"
                )
            saved_dp = int(cast(int, one["dp_size"]))
            # [[step, [[replica, [sample id, ...]], ...]], ...] as state_dict writes it (lists)
            for step, rows in cast("list[tuple[int, list[tuple[int, list[str]]]]]", one["steps"]):
                for replica, ids in rows:
                    known = self._steps.setdefault(int(step), {}).get(int(replica))
                    if known is not None and known != list(ids):
                        raise PlaneMismatchError(
                            f"two saved planes disagree at step {step}, replica {replica}"
                        )
                    self._steps[int(step)][int(replica)] = list(ids)
            self.dp_size = max(self.dp_size, saved_dp)
