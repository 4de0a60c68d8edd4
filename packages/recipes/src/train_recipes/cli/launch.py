"""Launching a training command: the config checked once, the run folder guarded, the ranks started.

``train-recipes sft|retrieval`` lands in :func:`train`. In the process the user ran, it loads the
config, runs the preflight and the data report (:func:`load_checked`), locks and checks the run
folder (:func:`guard_run_folder`), then either trains in this process, hands the run to Ray's
driver, or starts the local ranks through torch's elastic launcher (:func:`relaunch`), which run
the same command again under :mod:`train_recipes.run.launch_env`'s variables.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from train_recipes.run.launch_env import (
    GUARDED_OUTPUT_DIR,
    PREFLIGHT_DONE,
    is_rank_zero,
    under_launcher,
)

if TYPE_CHECKING:
    from train_recipes.cli.config_commands import Recipe
    from train_recipes.config.retrieval import RetrievalConfig
    from train_recipes.config.sft import SFTConfig
    from train_recipes.run.folder import RunLock
    from train_recipes.run.preemption import LauncherSignals, SignalTrap


# `train-recipes sft` with no config runs the embedded demo on this many local ranks.
DEMO_RANKS = 2


# Our spelling and torchrun's own.
NPROC_FLAGS = ("--nproc-per-node", "--nproc_per_node")


def relaunch(nproc: int, argv: Sequence[str], signals: LauncherSignals | None = None) -> int:
    """Start ``nproc`` local ranks through torch's elastic launcher (torchrun's own API).

    With ``signals``, SIGTERM and SIGINT are this process's, not the agent's: the ranks stop
    at a step boundary with a checkpoint (:mod:`train_recipes.run.preemption`).
    """
    from torch.distributed.run import parse_args, run

    # OMP threads: torchrun sets 1 per rank when unset; say it explicitly so a laptop's cores
    # are split between the ranks instead of oversubscribed.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # The ranks re-run the preflight (cheap) but leave its warnings to this process.
    os.environ[PREFLIGHT_DONE] = "1"
    agent = ["--standalone", "--nproc-per-node", str(nproc)]
    if signals is not None:
        agent += ["--signals-to-handle", signals.agent_signals]
    launcher = parse_args([*agent, "--module", "train_recipes.cli", *argv])
    codes: list[int] | None = None
    with contextlib.nullcontext() if signals is None else signals.installed():
        try:
            run(launcher)
        except ChildFailedError as err:
            # The failing ranks printed their own error; the launcher's report repeats it.
            codes = [failure.exitcode for failure in err.failures.values()]
    if signals is None:
        return 0 if codes is None else 1
    status, line = signals.outcome(codes)
    if line is not None:  # on a line of its own: the ranks' progress bar may be unterminated
        print(f"\ntrain-recipes sft: {line}", file=sys.stderr, flush=True)
    return status


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """The command line without ``--nproc-per-node`` (the relaunched ranks must not relaunch)."""
    out: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in NPROC_FLAGS:
            skip = True
            continue
        if item.startswith(tuple(f"{flag}=" for flag in NPROC_FLAGS)):
            continue
        out.append(item)
    return out


def _default_nproc(command: str, config: Path | None) -> int:
    return DEMO_RANKS if (command == "sft" and config is None) else 1


def with_ranks(
    args: argparse.Namespace, recipe: str, config: SFTConfig | RetrievalConfig
) -> SFTConfig | RetrievalConfig:
    """Settle the local ranks in ``args.nproc_per_node``; the config records them.

    ``--nproc-per-node``, else ``launch.nproc_per_node``, else the default (the run's
    config.yaml then says how many ranks it ran on).
    """
    from train_recipes.config.shared import LaunchConfig

    if args.nproc_per_node is None:
        args.nproc_per_node = config.launch.nproc_per_node or _default_nproc(recipe, args.config)
    local = LaunchConfig(nproc_per_node=local_world_size(args))
    return config if config.launch == local else dataclasses.replace(config, launch=local)


def run_defaults(
    args: argparse.Namespace,
    recipe: str,
    config: SFTConfig | RetrievalConfig,
    *,
    model_dir: str | None = None,
) -> tuple[SFTConfig | RetrievalConfig, tuple[str, ...]]:
    """The own-model defaults of the keys the command line leaves unset, then the local ranks.

    Returns:
        The config, and the line naming the defaults chosen (none for the demo model).
    """
    from train_recipes.cli.config_commands import given_keys
    from train_recipes.config.defaults import apply_run_defaults
    from train_recipes.config.sft import SFTConfig

    note = None
    if isinstance(config, SFTConfig):
        given = given_keys(args.config, overrides(args))
        config, note = apply_run_defaults(config, given, model_dir=model_dir)
    return with_ranks(args, recipe, config), (() if note is None else (note,))


def data_report_lines(config: SFTConfig | RetrievalConfig) -> tuple[str, ...]:
    """A sample of an SFT run's own data measured (raises ConfigError when it trains nothing)."""
    from train_recipes.config.sft import SFTConfig
    from train_recipes.data.report import data_report

    return tuple(data_report(config)) if isinstance(config, SFTConfig) else ()


def _prints_prelaunch() -> bool:
    """Whether this process prints the preflight's notes and warnings (once per job)."""
    return PREFLIGHT_DONE not in os.environ and is_rank_zero()


def world_size(args: argparse.Namespace) -> int:
    """The job's world size: the launcher's, else the local ranks this process will start."""
    if under_launcher():
        return int(os.environ["WORLD_SIZE"])
    return int(args.nproc_per_node)


def local_world_size(args: argparse.Namespace) -> int:
    """The ranks on this node: the launcher's, else the local ranks this process will start."""
    if under_launcher():
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return int(args.nproc_per_node)


# The shorthand options and the config keys they set.
_SHORTHANDS = (("--model", "model", "model.path"), ("--data", "data", "data.path"))


def overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides, with ``--model``, ``--data`` and ``--output-dir`` as overrides.

    Raises:
        ConfigError: a shorthand and its ``--set`` key are both given.
    """
    from train_recipes.config.loader import ConfigError

    overrides = list(args.set or [])
    for option, dest, key in _SHORTHANDS:
        value = getattr(args, dest, None)
        if value is None:
            continue
        if any(item.partition("=")[0].strip() == key for item in overrides):
            raise ConfigError(option, f"and --set {key}=... are both given; keep one of them")
        overrides.append(f"{key}={json.dumps(value)}")  # quoted: YAML reads the path as text
    if args.output_dir is not None:
        overrides.append(f"train.output_dir={args.output_dir}")
    return overrides


def load_checked(args: argparse.Namespace, kind: str) -> SFTConfig | RetrievalConfig:
    """Load the config and run the preflight (raises ConfigError); print its warnings once."""
    from train_recipes.cli.config_commands import load_recipe_config
    from train_recipes.cli.preflight import run_preflight
    from train_recipes.data.direct_inputs import resolve_inputs

    recipe: Recipe = "sft" if kind == "sft" else "retrieval"
    _, loaded = load_recipe_config(recipe, args.config, overrides(args))
    config = cast("SFTConfig | RetrievalConfig", loaded)  # the recipe asked for is one of them
    config = resolve_inputs(config)  # a chat file converted, a Hub id found, before any rank
    config, notes = run_defaults(args, recipe, config)
    checked = run_preflight(
        config,
        world_size=world_size(args),
        local_world_size=local_world_size(args),
        controller=getattr(args, "controller", "spmd"),
        ray_address=getattr(args, "ray_address", None),
    )
    if PREFLIGHT_DONE not in os.environ:  # our own launch's ranks: the launcher measured it
        notes += data_report_lines(config)
    if _prints_prelaunch():
        for note in notes:
            print(f"train-recipes {kind}: {note}", flush=True)
        for warning in checked.warnings:
            print(f"train-recipes {kind}: warning: {warning}", file=sys.stderr)
    return config


def guard_run_folder(
    args: argparse.Namespace, config: SFTConfig | RetrievalConfig
) -> tuple[RunLock | None, int | None]:
    """Lock and check the run folder before any rank exists; returns (lock, exit code or None).

    Done by the launching parent, or under a foreign launcher (torchrun) by rank 0 for the
    lock, the folder check and --overwrite and by every rank for the resume plan (read-only),
    so that all ranks agree on a finished run.
    """
    from train_recipes.config.sft import SFTConfig
    from train_recipes.run.end_state import run_finished
    from train_recipes.run.folder import lock_and_check_folder
    from train_recipes.run.resume import plan_resume

    out = Path(config.train.output_dir)
    resume = bool(getattr(args, "resume", False))
    if os.environ.get(GUARDED_OUTPUT_DIR) == str(out.resolve()):
        return None, None
    inputs: list[tuple[str, str | None]] = []
    if isinstance(config, SFTConfig):
        inputs = [
            ("data.path", config.data.path),
            ("data.eval_path", config.data.eval_path),
            ("model.path", config.model.path),
        ]
    lock = lock_and_check_folder(
        out, command=args.command, resume=resume, overwrite=args.overwrite, inputs=inputs
    )
    try:
        if resume and isinstance(config, SFTConfig):
            saved = plan_resume(config, world_size=world_size(args))
            if saved is not None and run_finished(
                out, trained_to=saved.step, steps=config.train.steps, export=config.train.export
            ):
                print(
                    f"train-recipes sft: the run in {out} finished at step {saved.step} "
                    f"(train.steps={config.train.steps}); nothing to resume (raise "
                    "train.steps to train longer)",
                    flush=True,
                )
                return lock, 0
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock, None


def _launcher_signals(config: SFTConfig | RetrievalConfig) -> LauncherSignals | None:
    """The launcher's handling of SIGTERM/SIGINT for an SFT run (None: torchrun's own)."""
    from train_recipes.config.sft import SFTConfig
    from train_recipes.run.preemption import LauncherSignals

    if not isinstance(config, SFTConfig):
        return None
    return LauncherSignals(
        output_dir=Path(config.train.output_dir),
        checkpoint=config.train.checkpoint_on_signal,
        grace_s=config.train.signal_grace_s,
    )


def _signal_trap(config: SFTConfig) -> SignalTrap:
    """This rank's SIGTERM/SIGINT trap.

    The grace period and the at-once line are the launcher's when it forwards the signals.
    """
    from train_recipes.run.preemption import LAUNCHER_OWNS_SIGNALS, SignalTrap

    forwarded = os.environ.get(LAUNCHER_OWNS_SIGNALS) == "1"
    return SignalTrap(
        output_dir=Path(config.train.output_dir),
        checkpoint=config.train.checkpoint_on_signal,
        grace_s=None if forwarded else config.train.signal_grace_s,
        say=not forwarded and is_rank_zero(),
    )


def train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run ``sft`` or ``retrieval``: here, on Ray, or on local ranks; returns the exit code."""
    from train_recipes.config.loader import ConfigError

    if under_launcher():
        from train_recipes.run.preemption import hold_signals
        from train_recipes.run.process_group import die_with_parent

        die_with_parent()  # a rank never outlives its launcher (no orphan keeps training)
        hold_signals()  # a stop signal during start-up waits for the run's trap
    lock = None
    try:
        if getattr(args, "controller", "spmd") == "ray" and under_launcher():
            raise ConfigError(
                "--controller", "'ray' starts its own ranks (Ray actors); run it without torchrun"
            )
        config = load_checked(args, args.command)
        lock, done = guard_run_folder(args, config)
    except ConfigError as err:
        print(f"train-recipes {args.command}: {err}", file=sys.stderr)
        return 2
    try:
        if done is not None:
            return done
        if getattr(args, "controller", "spmd") == "ray":  # this process drives Ray actors
            from train_recipes.controller.driver import main_on_ray

            return main_on_ray(
                config, world_size=args.nproc_per_node, resume=args.resume, address=args.ray_address
            )
        if args.nproc_per_node > 1 and not under_launcher():
            out = Path(config.train.output_dir).resolve()
            os.environ[GUARDED_OUTPUT_DIR] = str(out)
            return relaunch(args.nproc_per_node, strip_nproc(argv), _launcher_signals(config))
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
        from train_recipes.run.health import TrainingAborted
        from train_recipes.run.preemption import RunStopped

        try:
            if args.command == "sft":
                from train_recipes.config.sft import SFTConfig
                from train_recipes.sft.run import run_sft

                assert isinstance(config, SFTConfig)
                with _signal_trap(config) as trap:
                    run_sft(config, resume=args.resume, signals=trap)
            else:
                from train_recipes.config.retrieval import RetrievalConfig
                from train_recipes.retrieval.recipe import run_retrieval

                assert isinstance(config, RetrievalConfig)
                run_retrieval(config)
        except (TrainingAborted, RunStopped) as err:
            # Every rank aborts (or stops) at the same step; one line from rank 0 says why.
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"train-recipes {args.command}: {err}", file=sys.stderr, flush=True)
            return err.exit_code if isinstance(err, RunStopped) else 1
        from train_recipes.run.process_group import close_process_group

        close_process_group()
        return 0
    finally:
        if lock is not None:
            lock.release()
