"""Launching ``train-recipes grpo``: the config and the rollout file checked once, then the ranks.

In the process the user ran: the config is loaded and validated, a rollout file is read whole
with the policy's tokenizer (a bad row is one line, before any rank starts), the run folder is
locked and checked; then the run trains here (one rank) or on local ranks started through
torch's elastic launcher, which run the same command again (SPMD, in lock-step).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from train_recipes.cli.launch import overrides, world_size
from train_recipes.run.launch_env import is_rank_zero, under_launcher

if TYPE_CHECKING:
    from train_recipes.cli.preflight import DevicePlan
    from train_recipes.config.grpo import GRPOConfig

__all__ = ["grpo_plan", "launch_grpo"]


def _load(args: argparse.Namespace) -> GRPOConfig:
    """The validated config, with the rollout file's rows checked (raises one-line errors)."""
    from train_recipes.cli.config_commands import resolve_config_path
    from train_recipes.config.grpo import GRPOConfig
    from train_recipes.config.loader import ConfigError, load_config

    if args.controller == "ray":
        raise ConfigError(
            "--controller",
            "'ray' is not supported by grpo yet; run it without --controller (SPMD ranks in "
            "lock-step: rollout, update, the next rollout)",
        )
    path = None if args.config is None else resolve_config_path(args.config)
    config = load_config(GRPOConfig, path, overrides(args))
    if args.nproc_per_node is None:
        args.nproc_per_node = config.launch.nproc_per_node or 1
    if is_rank_zero():
        grpo_plan(config, nproc=world_size(args))
    return config


def grpo_plan(config: GRPOConfig, *, nproc: int) -> DevicePlan:
    """The checks of a GRPO config on ``nproc`` ranks, and its device plan.

    A rollout file is read whole with the policy's tokenizer. ``config show`` prints the plan
    (its dry run); a launch only checks.

    Raises:
        ConfigError: naming the key (``rollout.path`` for a bad row: its line and fault).
    """
    from train_recipes.cli.preflight import plan_devices
    from train_recipes.config.grpo import policy_sft_config
    from train_recipes.config.grpo_validation import validate_grpo
    from train_recipes.config.loader import ConfigError

    validate_grpo(config, world_size=nproc)
    sft = policy_sft_config(config)
    if config.rollout.source == "file":
        from train_recipes.data.processors import load_tokenizer
        from train_recipes.grpo.rollout_file import RolloutFileError, read_rollout_file

        assert config.rollout.path is not None  # validate_grpo enforces it
        try:
            read_rollout_file(
                config.rollout.path, load_tokenizer(sft), max_length=config.data.max_length
            )
        except RolloutFileError as err:
            raise ConfigError("rollout.path", str(err)) from None
    return plan_devices(sft, world_size=nproc, local_world_size=nproc)


def launch_grpo(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run ``train-recipes grpo``: here, or on local ranks; returns the exit code."""
    from train_recipes.cli.recipe_launch import run_or_relaunch
    from train_recipes.config.loader import ConfigError
    from train_recipes.run.folder import lock_and_check_folder

    if under_launcher():
        from train_recipes.run.process_group import die_with_parent

        die_with_parent()  # a rank never outlives its launcher
    try:
        config = _load(args)
        inputs = [
            ("model.path", config.model.path),
            ("data.prompts", config.data.prompts),
            ("rollout.path", config.rollout.path),
        ]
        lock = lock_and_check_folder(
            Path(config.train.output_dir),
            command="grpo",
            resume=args.resume,
            overwrite=args.overwrite,
            inputs=inputs,
        )
    except ConfigError as err:
        print(f"train-recipes grpo: {err}", file=sys.stderr)
        return 2
    try:
        from train_recipes.grpo.recipe import run_grpo

        return run_or_relaunch(
            args,
            argv,
            out=Path(config.train.output_dir),
            run=lambda: run_grpo(config, resume=args.resume),
        )
    finally:
        if lock is not None:
            lock.release()
