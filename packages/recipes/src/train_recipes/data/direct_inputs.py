"""Direct inputs: a chat file where a run wants a prepared dataset, a Hub id where it wants a folder.

- ``data.path``: a chat JSONL (``messages``, ShareGPT ``conversations`` or Alpaca
  ``instruction`` rows, told apart by the first row), a Parquet file, or a folder written by
  ``datasets``' ``save_to_disk`` (a ``DatasetDict``'s ``train`` split) is converted once by
  energon-sft into a prepared Energon dataset in the cache (:mod:`train_recipes.data.input_cache`);
  a prepared Energon dataset is used as it is.
- ``data.eval_split`` carves held-out rows out of such a file when ``data.eval_path`` is not
  set: a fraction in (0, 1), a count, 0 for none, or null (the default) for 5% of the rows, at
  most 200, none below 20 rows. The rows are drawn with a fixed seed from the row count alone,
  so every run (whatever ``train.seed``) holds out the same rows and never trains on them.
- ``data.eval_path``: a held-out file in another format (ShareGPT, Alpaca, Parquet,
  ``save_to_disk``) is mapped to ``messages`` rows in the cache.
- ``model.path``: ``org/name`` that is not a local folder is the snapshot in the local
  Hugging Face cache (``HF_HUB_CACHE``), found offline; a missing one is one line naming
  ``hf download org/name``.

:func:`resolve_inputs` runs in the launching process before any rank exists; the resolved paths
reach the ranks it starts through :data:`~train_recipes.run.launch_env.RESOLVED_INPUTS`, so they neither hash nor convert.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from train_recipes.config.loader import ConfigError
from train_recipes.config.retrieval import RetrievalConfig
from train_recipes.config.sft import SFTConfig
from train_recipes.data.input_cache import cache_root, content_digest, entry_key, publish_entry
from train_recipes.run.launch_env import RESOLVED_INPUTS

if TYPE_CHECKING:
    from energon_sft.sources import RowSource

__all__ = ["held_out_count", "resolve_inputs", "resolve_model_path"]

C = TypeVar("C", bound=SFTConfig | RetrievalConfig)

# Bumped when a conversion's output changes for the same input and settings.
CACHE_FORMAT = 1
# The held-out rows depend on the row count only (not train.seed): runs with different seeds
# are compared on the same rows.
SPLIT_SEED = 0
# data.eval_split=null: this share of the rows, at most AUTO_MAX (train.eval_samples' default),
# and nothing for files under AUTO_MIN_ROWS rows (too few to spare any).
AUTO_FRACTION, AUTO_MAX, AUTO_MIN_ROWS = 0.05, 200, 20
# What a Hub id looks like: one slash between two names (a local path wins when it exists).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

Echo = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- model


def resolve_model_path(value: str, *, key: str = "model.path") -> str:
    """A local folder as it is; a Hub id as its snapshot folder in the local Hugging Face cache.

    Raises:
        ConfigError: a Hub id that is not cached, or cached without weights.
    """
    if Path(value).exists() or not _HUB_ID.fullmatch(value):
        return value  # a folder, or a path the config checks reject by name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    fetch = f"fetch it with `hf download {value}` (or set {key} to a local model folder)"
    try:
        folder = Path(str(snapshot_download(value, local_files_only=True)))
    except LocalEntryNotFoundError:
        raise ConfigError(
            key,
            f"{value} is not a local folder and not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); {fetch}",
        ) from None
    weights = [*folder.glob("*.safetensors"), *folder.glob("*.bin"), *folder.glob("*.index.json")]
    if not (folder / "config.json").is_file() or not weights:
        raise ConfigError(
            key, f"the cached snapshot of {value} ({folder}) lacks its config or weights; {fetch}"
        )
    return str(folder)


# ----------------------------------------------------------------------------------- data


def held_out_count(eval_split: float | int | None, rows: int) -> int:
    """How many of ``rows`` rows ``data.eval_split`` holds out.

    Raises:
        ConfigError: a value outside (0, 1) / below 0, or one that leaves no row to train on.
    """
    if eval_split is None:
        return 0 if rows < AUTO_MIN_ROWS else min(AUTO_MAX, max(1, round(AUTO_FRACTION * rows)))
    if isinstance(eval_split, float):
        if not 0.0 < eval_split < 1.0:
            raise ConfigError(
                "data.eval_split",
                f"a fraction must lie in (0, 1), got {eval_split}; e.g. 0.05, or a row count",
            )
        count = max(1, round(eval_split * rows))
    else:
        count = eval_split
        if count < 0:
            raise ConfigError("data.eval_split", f"a row count must be >= 0, got {count}")
    if count >= rows:
        raise ConfigError(
            "data.eval_split",
            f"holds out {count} of the {rows} rows, leaving none to train on; hold out fewer",
        )
    return count


def _held_out_rows(count: int, rows: int) -> frozenset[int]:
    return frozenset(random.Random(SPLIT_SEED).sample(range(rows), count))


def _direct_source(path: str, key: str) -> RowSource | None:
    """The energon-sft source of a direct input; None for a prepared Energon dataset."""
    from energon_sft.sources import dataset_dict_splits, open_source

    p = Path(path)
    if p.is_dir() and (p / ".nv-meta").is_dir():
        return None
    if p.is_dir() and (splits := dataset_dict_splits(p)) is not None:
        if key != "data.path" or "train" not in splits:
            raise ConfigError(
                key, f"{p} holds a DatasetDict with splits {splits}; name one split's folder"
            )
        p = p / "train"
    try:
        return open_source(p)
    except (FileNotFoundError, ValueError) as err:
        prepared = " or a prepared Energon dataset (a folder with .nv-meta)" * (key == "data.path")
        raise ConfigError(key, f"{err}{prepared}") from None
    except ImportError as err:  # pyarrow (the parquet extra) is missing
        raise ConfigError(key, f"{err}; or install the extra: train-recipes[parquet]") from None


def _row_format(source: RowSource, key: str) -> str:
    """The format of the first row (messages, sharegpt, alpaca)."""
    from energon_sft.formats import guess_format
    from energon_sft.sources import read_rows

    first = next(read_rows([source]), None)
    row = first[2] if first is not None else None
    fmt = guess_format(row) if isinstance(row, dict) else None
    if fmt is None:
        got = sorted(row) if isinstance(row, dict) else f"{row!r}"[:80]
        raise ConfigError(
            key,
            f"the first row of {source.path} has {got}; expected chat rows with 'messages', "
            "ShareGPT 'conversations' or Alpaca 'instruction'/'output'",
        )
    return fmt


def _convert_data(config: SFTConfig, source: RowSource, echo: Echo) -> tuple[str, str | None]:
    """data.path's prepared dataset in the cache, and its held-out rows (converted once)."""
    from energon_sft.convert import BadRowsError, convert_files
    from energon_sft.progress import ConvertProgress
    from energon_sft.sources import count_rows

    fmt = _row_format(source, "data.path")
    split = config.data.eval_split if config.data.eval_path is None else 0
    root = cache_root()
    settings = {
        "cache_format": CACHE_FORMAT,
        "energon_sft": version("energon-sft"),
        "row_format": fmt,
        "eval_split": "auto" if split is None else split,
        "split_seed": SPLIT_SEED,
    }
    final = root / "datasets" / entry_key(content_digest(source.path, root), settings)
    given = config.data.path

    def build(tmp: Path) -> None:
        rows = count_rows([source])
        held = held_out_count(split, rows)
        echo(
            f"data.path {given}: converting {rows} {fmt} rows into {final} (once; later runs "
            "reuse it)"
        )
        progress = ConvertProgress(rows, bar=sys.stderr.isatty(), label="converting data.path")
        try:
            report = convert_files(
                [source.path],
                tmp / "energon",
                row_format=fmt,  # type: ignore[arg-type]
                progress=progress,
                on_prepare=progress.indexing,
                holdout=_held_out_rows(held, rows),
                holdout_path=tmp / "eval.jsonl" if held else None,
            )
        except BadRowsError as err:
            progress.close()
            for line in err.report.summary_lines():
                echo(f"  {line}")
            raise ConfigError(
                "data.path",
                f"{given}: {err}. Fix the rows, or drop them with `energon-sft convert {given} "
                f"DIR --format {fmt} --max-bad-fraction F` and set data.path=DIR",
            ) from None
        finally:
            progress.close()
        lines = report.summary_lines()
        if held:
            what = "auto: 5%, at most 200" if split is None else f"{split}"
            lines.append(f"held out {report.rows_held_out} rows (data.eval_split={what})")
        for line in lines:
            echo(f"  {line.replace(str(tmp), str(final))}")
        record = {"inputs": [str(source.path.resolve())], "settings": settings, "report": lines}
        (tmp / "source.json").write_text(json.dumps(record, indent=1))

    if not publish_entry(
        final, build, complete="source.json", on_wait=lambda: _waiting(echo, final)
    ):
        echo(f"data.path {given}: reusing converted dataset {final}")
    held_out = final / "eval.jsonl"
    return str(final / "energon"), str(held_out) if held_out.is_file() else None


def _waiting(echo: Echo, final: Path) -> None:
    echo(f"waiting for another process converting into {final}")


def _convert_eval(path: str, echo: Echo) -> str:
    """data.eval_path in `messages` JSONL as it is; another format mapped once into the cache."""
    from energon_sft.convert import BadRowsError, convert_to_jsonl

    source = _direct_source(path, "data.eval_path")
    if source is None:
        raise ConfigError(
            "data.eval_path",
            f"{path} is a prepared Energon dataset; give the held-out chats as a JSONL, a "
            "Parquet file or a save_to_disk folder",
        )
    fmt = _row_format(source, "data.eval_path")
    if source.kind == "jsonl" and fmt == "messages":
        return path
    root = cache_root()
    settings = {"cache_format": CACHE_FORMAT, "row_format": fmt, "eval": True}
    final = root / "evals" / entry_key(content_digest(source.path, root), settings)

    def build(tmp: Path) -> None:
        try:
            report = convert_to_jsonl([source.path], tmp / "eval.jsonl", row_format=fmt)  # type: ignore[arg-type]
        except BadRowsError as err:
            raise ConfigError("data.eval_path", f"{path}: {err}") from None
        echo(f"data.eval_path {path}: {report.rows_written} {fmt} rows as messages in {final}")

    publish_entry(final, build, complete="eval.jsonl", on_wait=lambda: _waiting(echo, final))
    return str(final / "eval.jsonl")


def _check_eval_split(config: SFTConfig, direct: bool) -> None:
    data = config.data
    if data.eval_split is None or data.eval_split == 0:
        return
    if data.eval_path is not None:
        raise ConfigError(
            "data.eval_split",
            f"and data.eval_path={data.eval_path} both give held-out rows; remove one of them",
        )
    if not direct:
        where = (
            f"data.path={data.path} is a prepared Energon dataset"
            if data.path is not None
            else "the demo has its own held-out questions (data.demo_eval_size)"
        )
        raise ConfigError(
            "data.eval_split",
            f"carves held-out rows while a chat file is converted, but {where}; set "
            "data.eval_path to a held-out chat file instead",
        )


# ---------------------------------------------------------------------------- the config


def _given(config: SFTConfig | RetrievalConfig) -> dict[str, str | float | None]:
    """The values resolution reads."""
    given: dict[str, str | float | None] = {"model.path": config.model.path}
    if isinstance(config, SFTConfig):
        data = config.data
        given |= {
            "data.path": data.path,
            "data.eval_path": data.eval_path,
            "data.eval_split": data.eval_split,
        }
    return given


def _resolve(config: SFTConfig | RetrievalConfig, echo: Echo) -> dict[str, str | None]:
    model = config.model.path
    resolved = {"model.path": None if model is None else resolve_model_path(model)}
    if isinstance(config, SFTConfig):
        data = config.data
        source = None if data.path is None else _direct_source(data.path, "data.path")
        _check_eval_split(config, direct=source is not None)
        path, carved = data.path, None
        if source is not None:
            path, carved = _convert_data(config, source, echo)
        eval_path = carved if data.eval_path is None else _convert_eval(data.eval_path, echo)
        resolved |= {"data.path": path, "data.eval_path": eval_path}
    return resolved


def resolve_inputs(config: C, *, echo: Echo = _stderr) -> C:
    """``config`` with its direct inputs resolved (see the module docstring).

    The launching process converts what is not cached yet and exports the resolution in
    :data:`~train_recipes.run.launch_env.RESOLVED_INPUTS`; a process that inherits it (a rank) applies it when the config gives
    the same values, without hashing or converting.

    Raises:
        ConfigError: one line naming the key and the fix.
    """
    given = _given(config)
    pinned = json.loads(os.environ.get(RESOLVED_INPUTS) or "{}")
    if pinned.get("given") == given:
        resolved = pinned["resolved"]
    else:
        resolved = _resolve(config, echo)
        os.environ[RESOLVED_INPUTS] = json.dumps({"given": given, "resolved": resolved})
    out: SFTConfig | RetrievalConfig
    if isinstance(config, SFTConfig):
        data = replace(
            config.data, path=resolved["data.path"], eval_path=resolved["data.eval_path"]
        )
        out = replace(config, data=data, model=replace(config.model, path=resolved["model.path"]))
    else:
        out = replace(config, model=replace(config.model, path=resolved["model.path"]))
    return cast(C, out)
