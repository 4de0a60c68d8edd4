"""The environment variables a launching process passes to the ranks it starts.

``train-recipes sft --nproc-per-node N`` does its checks once, in the process the user ran,
then starts N ranks through torch's elastic launcher; the ranks run the same command again.
What the launcher already did reaches them through these variables (and only these), so that
they neither repeat it nor see its traces as a user's mistake:

* :data:`PREFLIGHT_DONE` ("1"): the preflight ran and printed its notes and warnings; a rank
  re-runs its checks (cheap) silently and skips the data report.
* :data:`GUARDED_OUTPUT_DIR` (the run folder's resolved path): the launcher holds the folder's
  lock and checked the folder; the ranks must not lock it again nor refuse the lock file as a
  used folder.
* :data:`LAUNCHER_OWNS_SIGNALS` ("1"): the launcher traps SIGTERM/SIGINT and forwards them
  with its own grace period; a rank's trap neither starts its own clock nor prints the
  at-once line (:mod:`train_recipes.run.preemption`).
* :data:`RESOLVED_INPUTS` (JSON ``{"given": ..., "resolved": ...}``): a chat file converted or a
  Hub id found by the launcher; a rank applies it instead of hashing or converting again
  (:mod:`train_recipes.data.direct_inputs`).

torchrun's own variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``) say whether a process
is a rank; :func:`under_launcher` and :func:`is_rank_zero` read them.
"""

from __future__ import annotations

import os

__all__ = [
    "GUARDED_OUTPUT_DIR",
    "LAUNCHER_OWNS_SIGNALS",
    "PREFLIGHT_DONE",
    "RESOLVED_INPUTS",
    "is_rank_zero",
    "under_launcher",
]

PREFLIGHT_DONE = "TRAIN_RECIPES_PREFLIGHT_DONE"
GUARDED_OUTPUT_DIR = "TRAIN_RECIPES_GUARDED_OUTPUT_DIR"
LAUNCHER_OWNS_SIGNALS = "TRAIN_RECIPES_LAUNCHER_OWNS_SIGNALS"
RESOLVED_INPUTS = "TRAIN_RECIPES_RESOLVED_INPUTS"


def under_launcher() -> bool:
    """Whether this process is a rank started by torchrun or torch's elastic launcher."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_rank_zero() -> bool:
    """Whether this process is rank 0 (a process outside any launcher counts as rank 0)."""
    return os.environ.get("RANK", "0") == "0"
