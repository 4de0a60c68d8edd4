"""The run folder's safety rules.

What belongs to a run, when a folder may be (re)used, one live job per folder, and files that
are replaced whole (a killed job never leaves a half-written file where a reader would take it).

A fresh run refuses a folder that already holds something unless ``--resume`` (continue it) or
``--overwrite`` (replace it) is given. ``--overwrite`` removes only the entries a run writes
(:data:`RUN_ENTRIES`) and refuses when the folder holds anything else, so a mistyped
``output_dir`` pointing at a user's folder never loses a file that is not a run's.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from train_recipes.config.loader import ConfigError, JSONValue
from train_recipes.run.launch_env import GUARDED_OUTPUT_DIR, is_rank_zero

__all__ = [
    "CHECKPOINT_DIR",
    "CONFIG_FILE",
    "EXPORT_DIR",
    "HISTORY_FILE",
    "LOCK_FILE",
    "RUN_ENTRIES",
    "STATE_FILE",
    "RunFolderError",
    "RunLock",
    "check_output_dir",
    "clear_run",
    "publish_dir",
    "rank0_printer",
    "record_config_changes",
    "staging_dir",
    "write_atomic",
]

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
EXPORT_DIR = "hf_model"
CONFIG_FILE = "config.yaml"
HISTORY_FILE = "config_history.jsonl"
LOCK_FILE = ".lock"
STATE_FILE = "state.json"  # how far the run's end got (train_recipes.run.end_state)
DEMO_DATA_DIR = "data"

# Everything a recipe writes at the top of its run folder. `data` is the generated demo dataset
# (recognised by its settings stamp, see `_is_run_entry`).
RUN_ENTRIES = frozenset(
    {
        CONFIG_FILE,
        HISTORY_FILE,
        LOCK_FILE,
        CHECKPOINT_DIR,
        EXPORT_DIR,
        DEMO_DATA_DIR,
        "tokenizer",
        "metrics.jsonl",
        "summary.json",
        STATE_FILE,
        "loss.png",
        "tensorboard",
        "mlflow.db",  # MLflow's store when MLFLOW_TRACKING_URI is unset (trackers.MLFLOW_DB)
        "wandb",  # W&B's files: wandb.init(dir=<run folder>) writes <run folder>/wandb (trackers)
    }
)
# Leftovers of an interrupted atomic replacement (`write_atomic`, `publish_dir`).
_SUFFIXES = (".tmp", ".old")


class RunFolderError(ConfigError):
    """The run folder cannot be used as asked (used, locked, or holding foreign files)."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, message)
        self.key = "train.output_dir"


def _base_name(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _is_run_entry(entry: Path) -> bool:
    base = _base_name(entry.name)
    if base not in RUN_ENTRIES:
        return False
    if base == DEMO_DATA_DIR:
        # Only the demo dataset a run generated (stamped by write_demo_dataset), never a user's.
        return (entry / "settings.json").is_file()
    return True


def _contents(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name != LOCK_FILE)


def check_output_dir(
    output_dir: str | os.PathLike[str],
    *,
    resume: bool,
    overwrite: bool,
    inputs: Iterable[tuple[str, str | None]] = (),
) -> None:
    """Refuse a fresh run in a folder that already holds something (parent process, pre-launch).

    Args:
        output_dir: the run folder (``train.output_dir``).
        resume: ``--resume`` was given: a used folder is what is asked for.
        overwrite: ``--overwrite`` was given: the old run's files will be removed by
            :func:`clear_run` (checked here: only a run's own files, no input inside them).
        inputs: (config key, path) of the run's inputs (data.path, model.path, ...), which
            ``--overwrite`` must not delete.

    Raises:
        RunFolderError: one line naming the folder and the way out.
    """
    folder = Path(output_dir)
    if resume and overwrite:
        raise RunFolderError(
            f"--resume continues the run in {folder} and --overwrite deletes it; give one of them"
        )
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"train.output_dir {folder} is a file, not a folder; pick a folder")
    contents = _contents(folder)
    if not contents or resume:
        return
    names = ", ".join(p.name for p in contents[:4]) + (", ..." if len(contents) > 4 else "")
    if not overwrite:
        raise RunFolderError(
            f"train.output_dir {folder} is not empty ({names}); continue the run in it with "
            f"--resume, or delete its run files with --overwrite (or pick another --output-dir)"
        )
    foreign = [p.name for p in contents if not _is_run_entry(p)]
    if foreign:
        raise RunFolderError(
            f"--overwrite removes only a run's own files, but {folder} also holds "
            f"{', '.join(foreign)}; pick another --output-dir or move them away"
        )
    resolved = folder.resolve()
    for key, path in inputs:
        if path is None:
            continue
        inside = Path(path).resolve()
        if inside == resolved or resolved in inside.parents:
            raise RunFolderError(
                f"--overwrite would delete {key}={path}, which lies inside {folder}; "
                f"move it out or pick another --output-dir"
            )


def clear_run(output_dir: str | os.PathLike[str]) -> list[str]:
    """Delete the run files of ``output_dir`` (``--overwrite``; call while holding its lock).

    Only entries :func:`check_output_dir` accepted as a run's are removed; the lock file stays
    (removing a held lock file would let a second job lock a new file of the same name).

    Returns:
        The removed names.
    """
    removed = []
    for entry in _contents(Path(output_dir)):
        if not _is_run_entry(entry):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry.name)
    return removed


class RunLock:
    """An exclusive lock on a run folder, held for the whole job (``fcntl.flock``).

    The kernel drops the lock when the holder dies, SIGKILL included, so a stale lock file never
    blocks a later job. The holder writes its PID into the file for the error of a second job.
    Where ``fcntl`` does not exist (Windows) the folder is not locked (a warning says so).

    Args:
        output_dir: the run folder (created when missing).
    """

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.folder = Path(output_dir)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`RunFolderError` naming the folder and the holder's PID."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not on Linux/macOS
            logger.warning(
                "no fcntl on this platform: %s is not locked against a second job", self.folder
            )
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            holder = self.path.read_text().strip() or "unknown"
            raise RunFolderError(
                f"train.output_dir {self.folder} is in use by a live job (PID {holder}); wait for "
                f"it to end or stop it, or pick another --output-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays; see :func:`clear_run`)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def lock_and_check_folder(
    out: Path,
    *,
    command: str,
    resume: bool,
    overwrite: bool,
    inputs: Iterable[tuple[str, str | None]],
) -> RunLock | None:
    """Lock ``out`` and check it for this start (``--resume``/``--overwrite``) on rank zero.

    Every training command does this before its ranks start. Returns None where the launching
    parent of these ranks already did it, and on ranks other than 0. ``inputs`` are the config's
    input paths (key, path): one inside ``out`` that ``--overwrite`` would delete is refused.

    Raises:
        RunFolderError: the folder does not fit the start, in one line.
    """
    if os.environ.get(GUARDED_OUTPUT_DIR) == str(out.resolve()) or not is_rank_zero():
        return None
    lock = RunLock(out).acquire()
    try:
        check_output_dir(out, resume=resume, overwrite=overwrite, inputs=list(inputs))
        if overwrite and (removed := clear_run(out)):
            print(
                f"train-recipes {command}: --overwrite removed {', '.join(removed)} from {out}",
                flush=True,
            )
    except BaseException:
        lock.release()
        raise
    return lock


def rank0_printer(enabled: bool) -> Callable[[str], None]:
    """A function printing one line (flushed) on rank 0 and nothing elsewhere."""

    def say(line: str) -> None:
        if enabled:
            print(line, flush=True)

    return say


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` so that readers see the old file or the new one, never a part."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def staging_dir(target: str | os.PathLike[str], *, clear: bool = True) -> Path:
    """``<target>.tmp``: write a folder there, then :func:`publish_dir` it.

    Emptied of an interrupted write's leftovers when ``clear`` (rank 0).
    """
    target = Path(target)
    tmp = target.with_name(target.name + ".tmp")
    if clear:
        shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def publish_dir(tmp: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Move a fully written folder ``tmp`` to ``target``, replacing an existing one.

    The old folder is moved aside first and deleted last, so a crash leaves either the old or
    the new folder under ``target`` (plus a ``.tmp``/``.old`` leftover, never taken by a reader).
    A ``.old`` left by a crash between the two renames is the only copy while ``target`` is
    missing: it is kept until the new folder is in place.
    """
    tmp, target = Path(tmp), Path(target)
    old = target.with_name(target.name + ".old")
    if target.exists():
        if old.exists():  # target is complete: the leftover is an older copy
            shutil.rmtree(old)
        target.rename(old)
    tmp.rename(target)
    if old.exists():
        shutil.rmtree(old)
    return target


def record_config_changes(
    output_dir: str | os.PathLike[str],
    *,
    step: int,
    changes: dict[str, tuple[JSONValue, JSONValue]],
) -> None:
    """Keep ``config_history.jsonl`` in step with what trained (rank 0).

    Rows of runs resumed at or after ``step`` are dropped (their steps are being redone); a row
    ``{"step": step, "changes": {key: [old, new]}}`` is appended when ``changes`` is not empty.
    ``config.yaml`` itself always holds the current config.
    """
    path = Path(output_dir) / HISTORY_FILE
    rows: list[str] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                if int(json.loads(line)["step"]) < step:
                    rows.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed writer
    if changes:
        entry = {"step": step, "changes": {k: [old, new] for k, (old, new) in changes.items()}}
        rows.append(json.dumps(entry))
    if rows or path.exists():
        write_atomic(path, "".join(r + "\n" for r in rows))
