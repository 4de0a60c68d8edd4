"""The retrieval recipe's data: (query, passage) pairs, and the held-out split.

Pairs come from real text available offline: each documented function or class of a set of
Python standard-library modules gives (first docstring line -> query, the rest -> passage);
or from a JSONL file of the user's own pairs.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["docstring_pairs", "jsonl_pairs", "split_pairs"]


def docstring_pairs(
    modules: Sequence[str], *, min_passage_chars: int = 40
) -> list[tuple[str, str]]:
    """(query, passage) pairs from standard-library docstrings, in a deterministic order.

    The query is a docstring's first line, the passage the rest of it; duplicated queries
    (inherited or aliased docs) are dropped so every query has one right passage.
    """
    seen: dict[str, str] = {}
    dropped: set[str] = set()
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as err:  # e.g. a module this Python build lacks
            logger.warning("skipping module %s: %s", name, err)
            continue
        objects: list[tuple[str, Any]] = []
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            objects.append((attr, obj))
            if inspect.isclass(obj):
                objects.extend(
                    (f"{attr}.{m}", v)
                    for m, v in sorted(vars(obj).items())
                    if not m.startswith("_")
                )
        for _, obj in objects:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.isclass(obj) else None
            if not doc:
                continue
            first, _, rest = doc.strip().partition("\n")
            query, passage = first.strip(), " ".join(rest.split())
            if len(query) < 10 or len(passage) < min_passage_chars:
                continue
            if query in seen and seen[query] != passage:
                dropped.add(query)
            seen.setdefault(query, passage)
    return [(q, p) for q, p in seen.items() if q not in dropped]


def jsonl_pairs(path: str | Path) -> list[tuple[str, str]]:
    """Pairs from a JSONL file of ``{"query": ..., "passage": ...}`` rows."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [(r["query"], r["passage"]) for r in rows]


def split_pairs(
    pairs: list[tuple[str, str]], *, eval_size: int, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Shuffle with ``seed`` and hold out ``eval_size`` pairs."""
    if len(pairs) <= eval_size:
        raise ValueError(
            f"only {len(pairs)} pairs for data.eval_size={eval_size}; add modules or lower eval_size"
        )
    order = list(pairs)
    random.Random(seed).shuffle(order)
    return order[eval_size:], order[:eval_size]
