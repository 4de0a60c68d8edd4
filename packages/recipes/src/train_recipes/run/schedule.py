"""Training length and learning-rate schedule, shared by every recipe.

The schedule is a function of the optimizer update index only, so it is the one thing both
recipes (and a resumed run) must agree on; it lives here once.

- ``linear`` (the default): linear warm-up from ``lr / warmup_steps`` to ``lr``, then linear
  decay to ``min_lr_ratio * lr`` at the last step. This is the recipes' original schedule, kept
  bit for bit (transformers' ``linear`` starts the warm-up at 0 and decays to 0, so it differs).
- ``cosine``: ``transformers.get_scheduler("cosine_with_min_lr")`` with
  ``min_lr_rate=min_lr_ratio`` (``min_lr_ratio: 0`` is transformers' plain ``cosine``).
- ``constant``: ``transformers.get_scheduler("constant_with_warmup")``; ``min_lr_ratio`` is unused.

A resume that changes the schedule (``train.steps``, ``optim.warmup_steps``, ``optim.schedule``,
``optim.min_lr_ratio``) keeps the rate continuous (:class:`Rebase`): the new schedule's factor
plus the difference to the old factor at the resumed update, fading out linearly to nothing at
the new last step. Without it the factor would jump (a longer linear decay re-stretched over
the finished steps: 6x at 300 -> 400 steps); with it a linear decay goes on linearly from the
rate in force to the schedule's end value.

The training length is ``train.steps`` or, with ``train.epochs``, derived from the number of
training samples: one epoch is ``samples // (dp * micro_batch_size * gradient_accumulation)``
optimizer steps (the global batch of one step, in samples; the stream repeats, so the remainder
of less than one global batch carries into the next epoch). Packed rows hold a varying number
of samples, so epochs are refused with packing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler

    from train_recipes.config.sft import SFTConfig
    from train_recipes.config.shared import OptimConfig

__all__ = [
    "Rebase",
    "build_lr_scheduler",
    "energon_train_samples",
    "linear_with_floor",
    "schedule_factor",
    "steps_per_epoch",
    "total_steps",
]


def linear_with_floor(
    *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> Callable[[int], float]:
    """The ``linear`` schedule's LR factor of update index ``step`` (0-based)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return max(min_lr_ratio, 1.0 - (1.0 - min_lr_ratio) * progress)

    return factor


def build_lr_scheduler(
    optimizer: Optimizer, optim: OptimConfig, *, total_steps: int
) -> LRScheduler:
    """The LR scheduler of ``optim.schedule`` over ``total_steps`` optimizer updates.

    Args:
        optimizer: the optimizer whose groups' ``lr`` is the peak rate.
        optim: ``schedule``, ``warmup_steps`` and ``min_lr_ratio`` are read.
        total_steps: optimizer updates of the whole run.

    Returns:
        A ``LambdaLR`` (its ``state_dict`` holds no function, so checkpoints stay loadable).
    """
    from torch.optim.lr_scheduler import LambdaLR

    if optim.schedule == "linear":
        return LambdaLR(
            optimizer,
            linear_with_floor(
                warmup_steps=optim.warmup_steps,
                total_steps=total_steps,
                min_lr_ratio=optim.min_lr_ratio,
            ),
        )
    from transformers import get_scheduler

    if optim.schedule == "cosine":
        scheduler = get_scheduler(
            "cosine_with_min_lr",
            optimizer,
            num_warmup_steps=optim.warmup_steps,
            num_training_steps=total_steps,
            scheduler_specific_kwargs={"min_lr_rate": optim.min_lr_ratio},
        )
    elif optim.schedule == "constant":
        scheduler = get_scheduler(
            "constant_with_warmup", optimizer, num_warmup_steps=optim.warmup_steps
        )
    else:  # pragma: no cover - the config's Literal rejects anything else before launch
        raise ValueError(f"unknown optim.schedule {optim.schedule!r}")
    assert isinstance(scheduler, LambdaLR)
    return scheduler


@dataclass(kw_only=True, slots=True, frozen=True)
class Rebase:
    """A resume's correction of the schedule that keeps the learning rate continuous.

    The factor of update index ``e`` becomes ``schedule(e) + offset * (total - e) / (total -
    at)`` from ``at`` on, and ``schedule(e)`` from ``total`` on: it starts at the old curve's
    value and ends at the schedule's end value.

    Attributes:
        at: the scheduler's update index at the resume.
        offset: the old curve's factor at ``at`` minus the new schedule's.
        total: the last update index of the schedule (``train.steps`` of the resumed run).
    """

    at: int
    offset: float
    total: int

    def apply(self, factor: Callable[[int], float]) -> Callable[[int], float]:
        """``factor`` with this correction (a plain function: LambdaLR saves no state of it)."""
        at, offset, total = self.at, self.offset, self.total

        def rebased(step: int) -> float:
            if step >= total:
                return factor(step)
            return factor(step) + offset * min(1.0, (total - step) / max(1, total - at))

        return rebased


def schedule_factor(
    optim: OptimConfig, *, total_steps: int, rebase: Rebase | None = None
) -> Callable[[int], float]:
    """The LR factor of each update index, exactly as :func:`build_lr_scheduler`'s computes it.

    Args:
        optim: the schedule's settings.
        total_steps: optimizer updates of the whole run.
        rebase: a resume's correction, applied on top.
    """
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    # A scheduler over a throwaway optimizer: the factor without touching the run's rates.
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = build_lr_scheduler(probe, optim, total_steps=total_steps)
    assert isinstance(scheduler, LambdaLR)
    factor: Callable[[int], float] = scheduler.lr_lambdas[0]
    return factor if rebase is None else rebase.apply(factor)


def steps_per_epoch(
    *, samples: int, dp: int, micro_batch_size: int, gradient_accumulation_steps: int
) -> int:
    """Optimizer steps in one pass over ``samples`` (0 when one global batch is larger)."""
    return samples // (dp * micro_batch_size * gradient_accumulation_steps)


def energon_train_samples(path: str | Path) -> int:
    """Samples in the ``train`` split of a prepared Energon dataset (from its ``.nv-meta``).

    Raises:
        FileNotFoundError: ``path`` has no ``.nv-meta/.info.json`` or ``split.yaml``.
    """
    meta = Path(path) / ".nv-meta"
    info, split = meta / ".info.json", meta / "split.yaml"
    if not info.is_file() or not split.is_file():
        raise FileNotFoundError(
            f"{meta} lacks .info.json or split.yaml, so its sample count is unknown; "
            "prepare the dataset with `energon-sft convert`"
        )
    from braceexpand import braceexpand  # Energon's own shard-pattern syntax

    counts: dict[str, int] = json.loads(info.read_text())["shard_counts"]
    splits = yaml.safe_load(split.read_text()) or {}
    excluded = {name for pattern in splits.get("exclude") or [] for name in braceexpand(pattern)}
    shards = [
        name
        for pattern in (splits.get("split_parts") or {}).get("train") or []
        for name in braceexpand(pattern)
        if name not in excluded
    ]
    # Excludes with a "/" name single samples ("shard.tar/key") rather than shards.
    dropped = sum(1 for name in excluded if "/" in name and name.split("/")[0] in shards)
    return sum(int(counts.get(name, 0)) for name in shards) - dropped


def total_steps(config: SFTConfig, *, dp: int) -> int:
    """Optimizer steps of an SFT run: ``train.steps``, or ``train.epochs`` x steps per epoch.

    Args:
        config: the SFT config.
        dp: data-parallel replicas (world / (cp * tp)).

    Raises:
        ValueError: with epochs, the dataset's samples cannot be counted, or one epoch holds
            less than one global batch.
    """
    train, data = config.train, config.data
    if train.epochs is None:
        return train.steps
    samples = data.demo_train_size if data.path is None else energon_train_samples(data.path)
    per_epoch = steps_per_epoch(
        samples=samples,
        dp=dp,
        micro_batch_size=data.micro_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
    )
    if per_epoch < 1:
        raise ValueError(
            f"one epoch of {samples} samples is less than one global batch of "
            f"dp={dp} x data.micro_batch_size={data.micro_batch_size} x "
            f"train.gradient_accumulation_steps={train.gradient_accumulation_steps} samples; "
            "lower the batch or use train.steps"
        )
    return train.epochs * per_epoch


def resolve_length(config: SFTConfig, *, dp: int) -> SFTConfig:
    """``config`` with ``train.steps`` set to the run's step count (derived from the epochs)."""
    import dataclasses

    steps = total_steps(config, dp=dp)
    if steps == config.train.steps:
        return config
    return dataclasses.replace(config, train=dataclasses.replace(config.train, steps=steps))
