"""Experiment trackers the metric records are mirrored to: TensorBoard, W&B, MLflow.

None is required. Each is imported when a run asks for it: TensorBoard (``train.tensorboard``,
extra ``train-recipes[tensorboard]``) is skipped with a one-line notice when missing, since it
is on by default; W&B and MLflow (``train.loggers``, extras ``train-recipes[wandb]`` and
``train-recipes[mlflow]``) were asked for by name, so a missing one is an error naming the
extra (checked before launch by ``train_recipes.cli.preflight.check_extras``).

MLflow writes to ``MLFLOW_TRACKING_URI`` or, unset, to a SQLite database in the run folder
(``sqlite:///<run>/mlflow.db``): current mlflow refuses its file store ("./mlruns", in
maintenance mode). The URI is checked before launch (:func:`mlflow_uri_problem`).

Only finite numbers are sent; strings and lists (e.g. the skipped step numbers) stay in
``metrics.jsonl``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Protocol

from train_recipes.config.extras import install_hint

logger = logging.getLogger(__name__)

__all__ = [
    "EXTRAS",
    "MLFLOW_DB",
    "Tracker",
    "check_trackers",
    "import_extra",
    "mlflow_tracking_uri",
    "mlflow_uri_problem",
    "open_trackers",
]

#: Module imported for each tracker name, and the train-recipes extra that installs it.
EXTRAS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
#: Where an unset WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME puts the run.
DEFAULT_PROJECT = "train-recipes"
#: MLflow's store in the run folder when MLFLOW_TRACKING_URI is unset.
MLFLOW_DB = "mlflow.db"
# MLflow's database stores, reached through SQLAlchemy (in mlflow, not in mlflow-skinny).
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


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
            f"train.loggers lists {name!r}, but {module} is not installed; "
            f"{install_hint(extra)}, or remove {name!r} from train.loggers"
        ) from None


def mlflow_tracking_uri(out_dir: Path) -> str:
    """``MLFLOW_TRACKING_URI``, else the SQLite database ``<out_dir>/mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out_dir / MLFLOW_DB).resolve()}"


def check_trackers(loggers: Sequence[str], out_dir: Path) -> None:
    """Before launch: MLflow's store (``train.loggers`` lists mlflow) is one it will open.

    Raises:
        ConfigError: naming ``train.loggers`` and what to change.
    """
    if "mlflow" not in loggers:
        return
    problem = mlflow_uri_problem(mlflow_tracking_uri(out_dir), out_dir=out_dir)
    if problem is not None:
        from train_recipes.config.loader import ConfigError

        raise ConfigError("train.loggers", problem)


def mlflow_uri_problem(uri: str, *, out_dir: Path) -> str | None:
    """What would make MLflow fail on ``uri`` at the start of the run (None: nothing found).

    Checked without importing mlflow: the file store (refused by current mlflow unless
    ``MLFLOW_ALLOW_FILE_STORE`` is true), SQLAlchemy for the database stores, the folder of a
    SQLite file (the run folder itself is made by the run).
    """
    scheme, sep, rest = uri.partition(":")
    if not sep or scheme == "file" or len(scheme) == 1:  # a path (a Windows drive is 1 letter)
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true"):
            return None
        return (
            f"MLFLOW_TRACKING_URI={uri} is MLflow's file store, which current mlflow refuses "
            "(maintenance mode); unset MLFLOW_TRACKING_URI for the run folder's "
            f"sqlite:///<run>/{MLFLOW_DB}, use another database URI, or set "
            "MLFLOW_ALLOW_FILE_STORE=true"
        )
    base = scheme.split("+")[0]
    if base not in _DATABASE_SCHEMES:
        return None  # a tracking server (http, databricks, ...): reached at run time
    if importlib.util.find_spec("sqlalchemy") is None:
        return (
            f"MLflow's {base} store ({uri}) needs SQLAlchemy, which is not installed (mlflow-"
            f"skinny lacks it); {install_hint('mlflow')}"
        )
    if base == "sqlite" and rest.startswith("///"):
        folder = Path(rest[3:]).parent
        if not folder.is_dir() and folder.resolve() != out_dir.resolve():
            return f"the folder of MLflow's database {uri} does not exist; create {folder}"
    return None


def _flatten(tree: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
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
    def __init__(self, out_dir: Path, *, run_name: str, config: Mapping[str, object]) -> None:
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
    def __init__(self, out_dir: Path, *, run_name: str, config: Mapping[str, object]) -> None:
        self._mlflow = mlflow = import_extra("mlflow")
        # Not MLflow's default ./mlruns (a file store, refused by current mlflow) of whatever
        # folder the job was started from.
        mlflow.set_tracking_uri(mlflow_tracking_uri(out_dir))
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
    config: Mapping[str, object],
    start_step: int = 0,
    notice: Callable[[str], object] = print,
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
    from train_recipes.config.extras import module_available

    trackers: list[Tracker] = []
    if tensorboard:
        if not module_available("tensorboard"):
            notice(
                f"tensorboard is not installed: no TensorBoard events ({install_hint('tensorboard')}"
                ", or set train.tensorboard=false to silence this)"
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


def finite_scalars(record: Mapping[str, object]) -> dict[str, float]:
    """The finite int/float values of a metric record (bools and the rest left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
