"""Experiment trackers the metric records are mirrored to: TensorBoard, W&B, MLflow.

None is required. Each is imported when a run asks for it: TensorBoard (``train.tensorboard``,
extra ``train-recipes[tensorboard]``) is skipped with a one-line notice when missing, since it
is on by default; W&B and MLflow (``train.loggers``, extras ``train-recipes[wandb]`` and
``train-recipes[mlflow]``) were asked for by name, so a missing one is an error naming the
extra (checked before launch by ``train_recipes.preflight.check_extras``).

Only finite numbers are sent; strings and lists (e.g. the skipped step numbers) stay in
``metrics.jsonl``.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

logger = logging.getLogger(__name__)

__all__ = ["EXTRAS", "Tracker", "import_extra", "open_trackers"]

#: Module imported for each tracker name, and the train-recipes extra that installs it.
EXTRAS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
#: Where an unset WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME puts the run.
DEFAULT_PROJECT = "train-recipes"


class Tracker(Protocol):
    """What the run logger needs of a tracker."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record finite scalar ``values`` at optimizer step ``step``."""

    def close(self) -> None:
        """Flush and finish the run."""


def import_extra(name: str) -> ModuleType:
    """Import tracker ``name``'s module, or fail with one line naming the extra."""
    module, extra = EXTRAS[name]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"train.loggers lists {name!r}, but {module} is not installed; install the extra "
            f"`train-recipes[{extra}]` or remove {name!r} from train.loggers"
        ) from None


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{full}."))
        else:
            out[full] = value
    return out


class _TensorBoard:
    def __init__(self, out_dir: Path, *, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step + 1)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    def __init__(self, out_dir: Path, *, run_name: str, config: Mapping[str, Any]) -> None:
        wandb = import_extra("wandb")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            name=run_name,
            dir=str(out_dir),
            config=dict(config),
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


# MLflow accepts letters, digits, '_', '-', '.', ' ', ':' and '/' in metric names ("recall@10" not).
_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")


class _Mlflow:
    def __init__(self, out_dir: Path, *, run_name: str, config: Mapping[str, Any]) -> None:
        self._mlflow = mlflow = import_extra("mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # Not MLflow's default ./mlruns of whatever folder the job was started from.
            mlflow.set_tracking_uri((out_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT))
        mlflow.start_run(run_name=run_name)
        params = {k: str(v)[:500] for k, v in _flatten(config).items()}
        mlflow.log_params(params)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._mlflow.log_metrics({_MLFLOW_BAD.sub("_", k): v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def open_trackers(
    out_dir: Path,
    *,
    tensorboard: bool,
    loggers: Sequence[str],
    run_name: str,
    config: Mapping[str, Any],
    start_step: int = 0,
    notice: Any = print,
) -> list[Tracker]:
    """The trackers of one run (rank 0 only).

    Args:
        out_dir: the run directory (TensorBoard events, a local MLflow store).
        tensorboard: write TensorBoard events; skipped with a ``notice`` when not installed.
        loggers: "wandb" and/or "mlflow".
        run_name: the run's name in W&B / MLflow.
        config: the run's config as plain data (W&B config, MLflow params).
        start_step: first step of this process (TensorBoard drops later events of a crashed run).
        notice: prints a one-line notice.

    Raises:
        ImportError: a tracker of ``loggers`` is not installed (one line, naming the extra).
    """
    from train_recipes.preflight import module_available

    trackers: list[Tracker] = []
    if tensorboard:
        if not module_available("tensorboard"):
            notice(
                "tensorboard is not installed: no TensorBoard events (install "
                "`train-recipes[tensorboard]`, or set train.tensorboard=false to silence this)"
            )
        else:
            trackers.append(_TensorBoard(out_dir, start_step=start_step))
    for name in loggers:
        if name == "wandb":
            trackers.append(_Wandb(out_dir, run_name=run_name, config=config))
        elif name == "mlflow":
            trackers.append(_Mlflow(out_dir, run_name=run_name, config=config))
        else:
            raise ValueError(f"unknown tracker {name!r}; expected one of wandb, mlflow")
    return trackers


def finite_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite int/float values of a metric record (bools and the rest left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
