"""How ``dpo`` and ``grpo`` run once their config is checked and their folder locked.

Local ranks through torch's elastic launcher, or the recipe in this process (``sft`` and
``retrieval`` add Ray and the launcher's signal handling: :func:`train_recipes.cli.launch.train`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from train_recipes.run.launch_env import GUARDED_OUTPUT_DIR, is_rank_zero, under_launcher

__all__ = ["run_or_relaunch"]


def run_or_relaunch(
    args: argparse.Namespace, argv: Sequence[str], *, out: Path, run: Callable[[], object]
) -> int:
    """Start ``args.nproc_per_node`` local ranks running this command, or ``run()`` here.

    A run that ends by the skip policy (:class:`~train_recipes.run.health.TrainingAborted`) is
    one line from rank 0 and exit code 1; a run that ends normally closes its process group.
    """
    from train_recipes.cli.launch import relaunch, strip_nproc
    from train_recipes.run.health import TrainingAborted
    from train_recipes.run.process_group import close_process_group

    nproc = args.nproc_per_node
    if nproc is not None and nproc > 1 and not under_launcher():
        os.environ[GUARDED_OUTPUT_DIR] = str(out.resolve())
        return relaunch(nproc, strip_nproc(argv))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        run()
    except TrainingAborted as err:
        if is_rank_zero():
            print(f"train-recipes {args.command}: {err}", file=sys.stderr, flush=True)
        return 1
    close_process_group()
    return 0
