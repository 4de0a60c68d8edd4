"""``train-recipes dpo``: the config loaded and checked once, the run folder guarded, the ranks run.

In the process the user ran: the config (a file or a shipped name, with ``--set`` overrides)
is loaded, checked (:func:`train_recipes.config.dpo.validate_dpo`) and, for a pairs file,
every row is read and checked, so a bad key or row is one line before any rank starts. Then
the run folder is locked and checked, and the recipe runs in this process (one rank) or on
``--nproc-per-node`` local ranks started through torch's elastic launcher, which run this
command again.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from train_recipes.run.launch_env import under_launcher

if TYPE_CHECKING:
    from train_recipes.cli.preflight import DevicePlan
    from train_recipes.config.dpo import DPOConfig

__all__ = ["dpo_plan", "load_dpo_config", "run_dpo_command"]


def load_dpo_config(args: argparse.Namespace, *, world_size: int) -> DPOConfig:
    """The checked config of the command line (pairs files read and checked too).

    Raises:
        ConfigError: naming the key or option at fault, in one line.
    """
    from train_recipes.cli.config_commands import resolve_config_path
    from train_recipes.cli.launch import overrides
    from train_recipes.config.dpo import DPOConfig
    from train_recipes.config.loader import load_config

    path = None if args.config is None else resolve_config_path(args.config)
    config = load_config(DPOConfig, path, overrides(args))
    dpo_plan(config, nproc=world_size)  # the checks; the plan is config show's
    return config


def dpo_plan(config: DPOConfig, *, nproc: int) -> DevicePlan:
    """``config show``'s check of a DPO config on ``nproc`` local ranks, and its device plan.

    Raises:
        ConfigError: as :func:`load_dpo_config`.
    """
    from train_recipes.cli.preflight import plan_devices
    from train_recipes.config.dpo import policy_config, validate_dpo
    from train_recipes.config.loader import ConfigError
    from train_recipes.dpo.pairs import PairError, read_pair_rows

    validate_dpo(config, world_size=nproc)
    if config.data.path is not None:
        try:
            read_pair_rows(config.data.path)
        except PairError as err:
            raise ConfigError("data.path", str(err)) from None
    return plan_devices(policy_config(config), world_size=nproc, local_world_size=nproc)


def run_dpo_command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run ``train-recipes dpo``; returns the exit code (2 for a refused config, in one line)."""
    from train_recipes.cli.recipe_launch import run_or_relaunch
    from train_recipes.config.loader import ConfigError
    from train_recipes.run.folder import lock_and_check_folder

    if under_launcher():
        from train_recipes.run.process_group import die_with_parent

        die_with_parent()  # a rank never outlives its launcher
        world = int(os.environ["WORLD_SIZE"])
    lock = None
    try:
        if not under_launcher():
            nproc = args.nproc_per_node
            if nproc is None:
                from train_recipes.config.dpo import DPOConfig
                from train_recipes.config.loader import load_config

                # The rank count the config asks for, read before the checks that need it.
                path = None
                if args.config is not None:
                    from train_recipes.cli.config_commands import resolve_config_path

                    path = resolve_config_path(args.config)
                nproc = load_config(DPOConfig, path).launch.nproc_per_node or 1
            if nproc < 1:
                raise ConfigError("--nproc-per-node", f"must be >= 1, got {nproc}")
            args.nproc_per_node = world = nproc
        config = load_dpo_config(args, world_size=world)
        lock = lock_and_check_folder(
            Path(config.train.output_dir),
            command="dpo",
            resume=args.resume,
            overwrite=args.overwrite,
            inputs=[("data.path", config.data.path), ("model.path", config.model.path)],
        )
    except ConfigError as err:
        print(f"train-recipes dpo: {err}", file=sys.stderr)
        return 2
    try:
        from train_recipes.dpo.recipe import run_dpo

        return run_or_relaunch(
            args,
            argv,
            out=Path(config.train.output_dir),
            run=lambda: run_dpo(config, resume=args.resume),
        )
    finally:
        if lock is not None:
            lock.release()
