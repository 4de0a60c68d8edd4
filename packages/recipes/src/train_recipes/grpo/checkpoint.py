"""What a GRPO checkpoint holds besides the Engine's state, and the resume from it.

Each rank's extra state: the step, the rollout buffer (the batch being trained and how many
of its optimizer steps are done), the rollout source's position and generator, the loss
window and the run's records. A resume loads the newest complete checkpoint, so it continues
in the middle of a rollout batch with the same samples and the same losses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from train_recipes.grpo.buffer import RolloutBuffer
from train_recipes.grpo.rollouts import RolloutSource
from train_recipes.run.checkpoint_folder import checkpoint_dir, complete_checkpoints, prune

if TYPE_CHECKING:
    from train_engine import Engine, LossWindow

__all__ = ["GRPORecords", "Resumed", "restore_grpo", "save_grpo"]


@dataclass(kw_only=True, slots=True)
class GRPORecords:
    """The run's records that its summary reads (the same on every rank).

    Attributes:
        first_loss: the first logged loss.
        last_loss: the latest logged loss.
        accuracy_before: held-out exact match before training.
        reward_first: the first rollout batch's mean reward (all ranks).
        reward_last: the latest batch's.
        rollout_batches: batches drawn so far.
    """

    first_loss: float | None = None
    last_loss: float | None = None
    accuracy_before: float | None = None
    reward_first: float | None = None
    reward_last: float | None = None
    rollout_batches: int = 0

    def note_loss(self, loss: float | None) -> None:
        """Record a logged loss."""
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss

    def note_reward(self, reward: float) -> None:
        """Record a new batch's mean reward."""
        self.reward_first = reward if self.reward_first is None else self.reward_first
        self.reward_last = reward
        self.rollout_batches += 1


@dataclass(kw_only=True, slots=True, frozen=True)
class Resumed:
    """What a resume restored besides the Engine, the source and the window.

    Attributes:
        path: the checkpoint loaded.
        step: its step.
        buffer: the rollout batch in training (None: the next step draws one).
        records: the run's records.
    """

    path: Path
    step: int
    buffer: RolloutBuffer | None
    records: GRPORecords


def save_grpo(
    engine: Engine,
    out_dir: Path,
    step: int,
    *,
    buffer: RolloutBuffer | None,
    source: RolloutSource,
    window: LossWindow,
    records: GRPORecords,
    keep: int,
    is_main: bool,
) -> None:
    """Save the checkpoint of ``step`` (collective); keep the newest ``keep``."""
    import torch.distributed as dist

    extra = {
        "step": step,
        "buffer": None if buffer is None else buffer.state_dict(),
        "source": source.state_dict(),
        "window": window.state_dict(),
        "records": asdict(records),
    }
    engine.save_checkpoint(checkpoint_dir(out_dir, step), extra_state=extra)
    dist.barrier()
    if is_main:
        prune(out_dir, keep=keep, upto=step)


def restore_grpo(
    engine: Engine, out_dir: Path, *, source: RolloutSource, window: LossWindow
) -> Resumed | None:
    """Load the newest complete checkpoint of ``out_dir`` (collective); None without one.

    Raises:
        ValueError: the checkpoint was written by another number of ranks (its per-rank rollout
            buffers and generators do not map onto these ranks).
    """
    found = complete_checkpoints(out_dir)
    if not found:
        return None
    extra = cast("dict[str, Any] | None", engine.load_checkpoint(found[0]))
    if extra is None:
        raise ValueError(
            f"{found[0]} was written by another number of ranks; resume a GRPO run with the "
            "world size it was started with"
        )
    source.load_state_dict(extra["source"])
    window.load_state_dict(extra["window"])
    saved = extra["buffer"]
    return Resumed(
        path=found[0],
        step=int(extra["step"]),
        buffer=None if saved is None else RolloutBuffer.from_state_dict(saved),
        records=GRPORecords(**extra["records"]),
    )
