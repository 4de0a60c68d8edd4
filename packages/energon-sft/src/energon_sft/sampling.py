"""The first samples of a prepared dataset, read straight from its files (no loader).

A look at the data before training (lengths, trained tokens) needs a few hundred cooked samples
in a second, not a loader's start-up: the tar shards of the train split are read in order
(`.nv-meta/split.yaml`), members grouped by sample key into the crude dicts Energon builds,
and cooked by the cooker the loader would pick (`sft_format: sharegpt` in the dataset's
subflavors: ShareGPT rows; else canonical rows). A JSONL file prepared as a crude dataset is
read line by line. Samples a cooker rejects are counted, not returned.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from braceexpand import braceexpand

from energon_sft.cookers import cook_chat, cook_sharegpt
from energon_sft.errors import BadSampleError
from energon_sft.schema import ChatSample

__all__ = ["FirstSamples", "first_samples"]


@dataclass(kw_only=True, slots=True)
class FirstSamples:
    """The samples read, and how many rows the cookers rejected on the way."""

    samples: list[ChatSample]
    rejected: int


def _crude(key: str, members: dict[str, Any]) -> dict[str, Any]:
    return {**members, "__key__": key, "__restore_key__": (), "__sources__": ()}


def _tar_samples(path: Path, split_part: str) -> Iterator[dict[str, Any]]:
    meta = path / ".nv-meta"
    split = yaml.safe_load((meta / "split.yaml").read_text()) or {}
    excluded = {name for pattern in split.get("exclude") or [] for name in braceexpand(pattern)}
    for pattern in (split.get("split_parts") or {}).get(split_part) or []:
        for name in braceexpand(pattern):
            if name in excluded:
                continue
            with tarfile.open(path / name) as tar:
                key, members = None, {}
                for info in tar:
                    if not info.isfile():
                        continue
                    base = Path(info.name).name
                    sample, _, member = base.partition(".")
                    if sample != key and key is not None:
                        yield _crude(key, members)
                        members = {}
                    key = sample
                    data = tar.extractfile(info)
                    members[member] = data.read() if data is not None else b""
                if key is not None:
                    yield _crude(key, members)


def _jsonl_samples(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as lines:
        for i, line in enumerate(lines):
            if line.strip():
                yield _crude(f"{i:09d}", {"json": json.loads(line)})


def first_samples(path: str | Path, *, limit: int, split_part: str = "train") -> FirstSamples:
    """Up to `limit` cooked samples from the start of a prepared dataset's split.

    Args:
        path: a prepared dataset folder (tar shards and `.nv-meta`) or a prepared JSONL file.
        limit: samples to return at most.
        split_part: the split read (tar datasets).

    Raises:
        FileNotFoundError: `path` is neither a prepared folder nor a JSONL file.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".jsonl":
        crude: Iterator[dict[str, Any]] = _jsonl_samples(path)
        subflavors: dict[str, Any] = {}
    elif (path / ".nv-meta" / "split.yaml").is_file():
        crude = _tar_samples(path, split_part)
        described = path / ".nv-meta" / "dataset.yaml"
        loaded = yaml.safe_load(described.read_text()) if described.is_file() else None
        subflavors = (loaded or {}).get("subflavors") or {}
    else:
        raise FileNotFoundError(f"{path} is neither a prepared dataset folder nor a JSONL file")
    cook = cook_sharegpt if subflavors.get("sft_format") == "sharegpt" else cook_chat
    out = FirstSamples(samples=[], rejected=0)
    for row in crude:
        if len(out.samples) >= limit:
            break
        try:
            out.samples.append(cook(row))
        except BadSampleError:
            out.rejected += 1
    return out
