"""Which config changes a resume applies, and which it refuses.

Every config field is either applied on resume (:data:`CHANGEABLE`) or refused with a per-field
diff: the others define the trained model, the data stream or the layout. A change of the
learning-rate schedule (:data:`SCHEDULE_KEYS`) keeps the rate continuous at the resumed step
(:func:`continue_schedule`; the curve is in :mod:`train_recipes.run.schedule`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeAlias, TypedDict, cast

from train_recipes.config.loader import ConfigError, JSONValue, config_from_dict, to_dict
from train_recipes.config.sft import SFTConfig
from train_recipes.run.schedule import Rebase, schedule_factor

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "CHANGEABLE",
    "SCHEDULE_KEYS",
    "ConfigChanges",
    "config_changes",
    "continue_schedule",
    "schedule_line",
]

#: ``key -> (old, new)`` of the config fields a resume changes (plain data, as in config.yaml).
ConfigChanges: TypeAlias = dict[str, tuple[JSONValue, JSONValue]]


class _SavedRebase(TypedDict):
    """A checkpoint's ``lr_rebase``: :class:`Rebase` as ``dataclasses.asdict`` wrote it."""

    at: int
    offset: float
    total: int


# Config keys a resume applies. Everything else must equal the checkpoint's config.
CHANGEABLE = frozenset(
    {
        # length, cadence and outputs
        "train.steps",
        "train.epochs",
        "train.log_every",
        "train.loss_window",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.checkpoint_optimizer",  # a resume without optimizer state says so itself
        "train.storage_check",
        "train.export",
        "train.tensorboard",
        "train.device",
        "train.output_dir",  # the folder was moved
        "train.loggers",
        "train.max_consecutive_skips",
        "train.collective_timeout_s",
        "train.checkpoint_on_signal",
        "train.signal_grace_s",
        "train.peak_tflops",  # what MFU is reported against
        "launch.nproc_per_node",  # another dp size: checked against the loader's shards
        "lora.export",
        # evaluation (a change drops the accuracy measured before training: another test set)
        "train.eval_samples",
        "train.eval_max_new_tokens",
        "data.eval_path",
        "train.eval_every",
        "train.eval_loss_samples",
        # optimisation: the Engine takes the new window; the optimizer and the scheduler take
        # the new hyperparameters and base rates (not the checkpoint's)
        "train.gradient_accumulation_steps",
        "optim.lr",
        "optim.weight_decay",
        "optim.betas",
        "optim.eps",
        "optim.warmup_steps",
        "optim.schedule",
        "optim.nonfinite",
        "optim.min_lr_ratio",
        "optim.max_grad_norm",
        "optim.fused",
        # speed knobs with the same parameters and checkpoints
        "model.compile",
        "model.compile_memory_budget",
        "model.fused_loss_chunk_tokens",
        "model.fused_loss_trained_only",
        "model.sdpa_backends",
        "model.attn_implementation",
        "parallel.fsdp.reshard_after_forward",
        "parallel.fsdp.cpu_offload",
    }
)
_CHANGEABLE_PREFIXES = ("parallel.ddp.",)
#: The keys that shape the learning-rate curve besides its peak (``optim.lr``, which a resume
#: applies as a new peak). ``train.epochs`` changes it through the ``train.steps`` it sets.
SCHEDULE_KEYS = ("train.steps", "optim.warmup_steps", "optim.schedule", "optim.min_lr_ratio")
# (key, saved, new) changes applied although the key is not changeable. A checkpoint written
# before optim.master_weights existed reads null and holds torch AdamW's state, also for bf16
# parameters (where null now means MasterWeightAdamW): false builds that optimizer again.
_APPLIED_CHANGES = frozenset({("optim.master_weights", None, False)})
_SHARDS_KEY = "data.num_logical_shards"


def _flat(tree: Mapping[str, JSONValue], prefix: str = "") -> dict[str, JSONValue]:
    out: dict[str, JSONValue] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def config_changes(
    saved: Mapping[str, object],
    config: SFTConfig,
    *,
    saved_shards: int | None,
    new_shards: int,
) -> ConfigChanges:
    """The config changes a resume applies; refuses the others.

    Args:
        saved: the checkpoint's config (plain data, as :func:`to_dict` writes it).
        config: the config of the resuming job.
        saved_shards: the saved loader's logical shard count (None when unknown).
        new_shards: the resuming job's (``data.num_logical_shards`` or its dp size).

    Returns:
        ``key -> (old, new)`` for every changed field that is applied.

    Raises:
        ConfigError: one line listing every refused ``key: old -> new``.
    """
    old = _flat(to_dict(config_from_dict(SFTConfig, saved)))
    new = _flat(to_dict(config))
    applied: ConfigChanges = {}
    refused: list[str] = []
    for key in sorted(set(old) | set(new)):
        if key == _SHARDS_KEY:
            continue  # compared as the effective shard count below
        before, after = old.get(key), new.get(key)
        if before == after:
            continue
        if (
            key in CHANGEABLE
            or key.startswith(_CHANGEABLE_PREFIXES)
            or (key, before, after) in _APPLIED_CHANGES
        ):
            applied[key] = (before, after)
        else:
            refused.append(f"{key}: {before!r} -> {after!r}")
    if saved_shards is not None and saved_shards != new_shards:
        raise ConfigError(
            _SHARDS_KEY,
            f"the checkpoint's loader has {saved_shards} logical shards, this job would use "
            f"{new_shards}; a resume keeps the shards and runs on a dp size that divides them: "
            f"--set {_SHARDS_KEY}={saved_shards} with dp in "
            f"{[d for d in range(1, saved_shards + 1) if saved_shards % d == 0]}",
        )
    if old.get(_SHARDS_KEY) != new.get(_SHARDS_KEY) and saved_shards == new_shards:
        applied[_SHARDS_KEY] = (old.get(_SHARDS_KEY), new.get(_SHARDS_KEY))
    if refused:
        first = refused[0].split(":", 1)[0]
        raise ConfigError(
            first,
            f"cannot change on --resume (the model, the data stream or the layout would no "
            f"longer be the checkpoint's): {'; '.join(refused)}; resume with the saved values "
            f"(config.yaml) or start a new run in another --output-dir",
        )
    return applied


def continue_schedule(
    saved: Mapping[str, object], config: SFTConfig, *, at: int, changes: ConfigChanges
) -> Rebase | None:
    """The correction that keeps the learning-rate factor continuous at update index ``at``.

    Args:
        saved: the checkpoint's extra state (its ``config`` and ``lr_rebase``).
        config: the resuming job's config.
        at: the scheduler's update index at the checkpoint.
        changes: the config changes the resume applies.

    Returns:
        The saved correction when the schedule is unchanged (the same curve, bit for bit), a
        new one when the old curve and the new schedule part at ``at``, else None.
    """
    old_rebase = cast("_SavedRebase | None", saved.get("lr_rebase"))
    rebase = None if old_rebase is None else Rebase(**old_rebase)
    if saved.get("config") is None or not set(SCHEDULE_KEYS) & set(changes):
        return rebase
    old = config_from_dict(SFTConfig, cast("Mapping[str, object]", saved["config"]))
    before = schedule_factor(old.optim, total_steps=old.train.steps, rebase=rebase)(at)
    after = schedule_factor(config.optim, total_steps=config.train.steps)(at)
    if before == after:
        return None
    return Rebase(at=at, offset=before - after, total=config.train.steps)


def schedule_line(
    scheduler: LRScheduler, config: SFTConfig, rebase: Rebase, *, step: int, keys: list[str]
) -> str:
    """The line saying what a resume does to the learning-rate curve after ``keys`` changed."""
    peak = float(scheduler.base_lrs[0])
    plain = schedule_factor(config.optim, total_steps=config.train.steps)
    end = config.train.steps
    return (
        f"resume keeps the learning rate continuous across the change of {', '.join(keys)}: "
        f"{peak * (plain(rebase.at) + rebase.offset):.3g} at step {step} (the checkpoint's "
        f"curve), then the new schedule's shape to {peak * plain(end):.3g} at step {end} "
        f"(the new schedule alone would jump to {peak * plain(rebase.at):.3g})"
    )
