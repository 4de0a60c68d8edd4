"""The ``train-recipes`` command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.requirements import Requirement

if TYPE_CHECKING:
    from train_recipes.cli.config_commands import Recipe
    from train_recipes.config.sft import SFTConfig
    from train_recipes.run.folder import RunLock
    from train_recipes.run.preemption import LauncherSignals, SignalTrap

# The library packages whose versions this distribution pins exactly.
COMPONENTS = ("train-engine", "cp-sharder", "moe-dispatch", "vocab-parallel", "energon-sft")

# `train-recipes sft` with no config runs the embedded demo on this many local ranks.
DEMO_RANKS = 2

# Our spelling and torchrun's own.
NPROC_FLAGS = ("--nproc-per-node", "--nproc_per_node")

# Set by the relaunch for its ranks: the launching process has run the preflight already.
_PREFLIGHT_DONE = "TRAIN_RECIPES_PREFLIGHT_DONE"


def pinned_components() -> dict[str, str]:
    """The exact versions of the library packages this installation of train-recipes was tested with."""
    pins = {}
    for line in requires("train-recipes") or []:
        req = Requirement(line)
        if req.name in COMPONENTS and req.marker is None:
            (spec,) = req.specifier
            pins[req.name] = spec.version
    return pins


def _versions(_: argparse.Namespace) -> int:
    mismatched = 0
    print(f"train-recipes {version('train-recipes')}")
    for name, pinned in pinned_components().items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = "missing"
        flag = "" if installed == pinned else "  <-- differs from the tested set"
        mismatched += bool(flag)
        print(f"  {name:<16} pinned {pinned:<10} installed {installed}{flag}")
    return 1 if mismatched else 0


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _relaunch(nproc: int, argv: Sequence[str], signals: LauncherSignals | None = None) -> int:
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
    os.environ[_PREFLIGHT_DONE] = "1"
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


def _strip_nproc(argv: Sequence[str]) -> list[str]:
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


def _with_ranks(args: argparse.Namespace, recipe: str, config: Any) -> Any:
    """Settle the local ranks in ``args.nproc_per_node``; the config records them.

    ``--nproc-per-node``, else ``launch.nproc_per_node``, else the default (the run's
    config.yaml then says how many ranks it ran on).
    """
    from train_recipes.config.shared import LaunchConfig

    if args.nproc_per_node is None:
        args.nproc_per_node = config.launch.nproc_per_node or _default_nproc(recipe, args.config)
    local = LaunchConfig(nproc_per_node=_local_world_size(args))
    return config if config.launch == local else dataclasses.replace(config, launch=local)


def _run_defaults(
    args: argparse.Namespace, recipe: str, config: Any, *, model_dir: str | None = None
) -> tuple[Any, tuple[str, ...]]:
    """The own-model defaults of the keys the command line leaves unset, then the local ranks.

    Returns:
        The config, and the line naming the defaults chosen (none for the demo model).
    """
    from train_recipes.cli.config_commands import given_keys
    from train_recipes.config.defaults import apply_run_defaults
    from train_recipes.config.sft import SFTConfig

    note = None
    if isinstance(config, SFTConfig):
        given = given_keys(args.config, _overrides(args))
        config, note = apply_run_defaults(config, given, model_dir=model_dir)
    return _with_ranks(args, recipe, config), (() if note is None else (note,))


def _data_report(config: Any) -> tuple[str, ...]:
    """A sample of an SFT run's own data measured (raises ConfigError when it trains nothing)."""
    from train_recipes.config.sft import SFTConfig
    from train_recipes.data.report import data_report

    return tuple(data_report(config)) if isinstance(config, SFTConfig) else ()


def _prints_prelaunch() -> bool:
    """Whether this process prints the preflight's notes and warnings (once per job)."""
    return _PREFLIGHT_DONE not in os.environ and os.environ.get("RANK", "0") == "0"


def _world_size(args: argparse.Namespace) -> int:
    if _under_launcher():
        return int(os.environ["WORLD_SIZE"])
    return int(args.nproc_per_node)


def _local_world_size(args: argparse.Namespace) -> int:
    if _under_launcher():
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return int(args.nproc_per_node)


# The shorthand options and the config keys they set.
_SHORTHANDS = (("--model", "model", "model.path"), ("--data", "data", "data.path"))


def _overrides(args: argparse.Namespace) -> list[str]:
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


def _load(args: argparse.Namespace, kind: str) -> object:
    """Load the config and run the preflight (raises ConfigError); print its warnings once."""
    from train_recipes.cli.config_commands import load_recipe_config
    from train_recipes.cli.preflight import run_preflight
    from train_recipes.data.direct_inputs import resolve_inputs

    recipe: Recipe = "sft" if kind == "sft" else "retrieval"
    _, config = load_recipe_config(recipe, args.config, _overrides(args))
    config = resolve_inputs(config)  # a chat file converted, a Hub id found, before any rank
    config, notes = _run_defaults(args, recipe, config)
    checked = run_preflight(
        config,
        world_size=_world_size(args),
        local_world_size=_local_world_size(args),
        controller=getattr(args, "controller", "spmd"),
        ray_address=getattr(args, "ray_address", None),
    )
    if _PREFLIGHT_DONE not in os.environ:  # our own launch's ranks: the launcher measured it
        notes += _data_report(config)
    if _prints_prelaunch():
        for note in notes:
            print(f"train-recipes {kind}: {note}", flush=True)
        for warning in checked.warnings:
            print(f"train-recipes {kind}: warning: {warning}", file=sys.stderr)
    return config


# Set by a launching parent that holds the run folder's lock and has checked the folder, for
# the ranks it starts (they must neither lock again nor see the lock file as a used folder).
_GUARDED_ENV = "TRAIN_RECIPES_GUARDED_OUTPUT_DIR"


def _guard_run_folder(
    args: argparse.Namespace, config: object
) -> tuple[RunLock | None, int | None]:
    """Lock and check the run folder before any rank exists; returns (lock, exit code or None).

    Done by the launching parent, or under a foreign launcher (torchrun) by rank 0 for the
    lock, the folder check and --overwrite and by every rank for the resume plan (read-only),
    so that all ranks agree on a finished run.
    """
    from train_recipes.config.sft import SFTConfig
    from train_recipes.run.checkpoints import plan_resume
    from train_recipes.run.end_state import run_finished
    from train_recipes.run.folder import RunLock, check_output_dir, clear_run

    out = Path(config.train.output_dir)  # type: ignore[attr-defined]
    resume = bool(getattr(args, "resume", False))
    if os.environ.get(_GUARDED_ENV) == str(out.resolve()):
        return None, None
    lock = RunLock(out).acquire() if os.environ.get("RANK", "0") == "0" else None
    try:
        if lock is not None:
            inputs: list[tuple[str, str | None]] = []
            if isinstance(config, SFTConfig):
                inputs = [
                    ("data.path", config.data.path),
                    ("data.eval_path", config.data.eval_path),
                    ("model.path", config.model.path),
                ]
            check_output_dir(out, resume=resume, overwrite=args.overwrite, inputs=inputs)
            if args.overwrite:
                removed = clear_run(out)
                if removed:
                    print(
                        f"train-recipes {args.command}: --overwrite removed "
                        f"{', '.join(removed)} from {out}",
                        flush=True,
                    )
        if resume and isinstance(config, SFTConfig):
            saved = plan_resume(config, world_size=_world_size(args))
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


def _launcher_signals(config: object) -> LauncherSignals | None:
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
        say=not forwarded and os.environ.get("RANK", "0") == "0",
    )


def _train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from train_recipes.config.loader import ConfigError

    if _under_launcher():
        from train_recipes.run.preemption import hold_signals
        from train_recipes.run.process_group import die_with_parent

        die_with_parent()  # a rank never outlives its launcher (no orphan keeps training)
        hold_signals()  # a stop signal during start-up waits for the run's trap
    lock = None
    try:
        if getattr(args, "controller", "spmd") == "ray" and _under_launcher():
            raise ConfigError(
                "--controller", "'ray' starts its own ranks (Ray actors); run it without torchrun"
            )
        config = _load(args, args.command)
        lock, done = _guard_run_folder(args, config)
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
        if args.nproc_per_node > 1 and not _under_launcher():
            out = Path(config.train.output_dir).resolve()  # type: ignore[attr-defined]
            os.environ[_GUARDED_ENV] = str(out)
            return _relaunch(args.nproc_per_node, _strip_nproc(argv), _launcher_signals(config))
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
        from train_recipes.loop.health import TrainingAborted
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
        return 0
    finally:
        if lock is not None:
            lock.release()


def _demo_data(args: argparse.Namespace) -> int:
    from train_recipes.data.demo import write_demo_dataset

    split = write_demo_dataset(
        args.out,
        task=args.task,
        train_size=args.train_size,
        eval_size=args.eval_size,
        seed=args.seed,
    )
    print(f"train chats      {split.train_jsonl}")
    print(f"held-out chats   {split.eval_jsonl}")
    print(f"Energon dataset  {split.energon_dir}   (use as data.path)")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from train_recipes.cli.config_commands import UsageError
    from train_recipes.config.extras import install_hint, module_available
    from train_recipes.loop.metrics import METRICS_FILE, plot_loss

    metrics = args.run / METRICS_FILE if args.run.is_dir() else args.run
    if not metrics.is_file():
        raise UsageError(f"{metrics} does not exist; pass a run directory or its {METRICS_FILE}")
    if not module_available("matplotlib"):
        raise UsageError(f"drawing loss.png needs matplotlib; {install_hint('plot')}")
    print(plot_loss(args.run, args.out))
    return 0


def _config_ls(_: argparse.Namespace) -> int:
    from train_recipes.cli.config_commands import list_configs

    print(list_configs())
    return 0


def _config_cp(args: argparse.Namespace) -> int:
    from train_recipes.cli.config_commands import copy_config

    print(copy_config(args.name, args.dest, force=args.force))
    return 0


def _config_show(args: argparse.Namespace) -> int:
    from train_recipes.cli.config_commands import load_recipe_config, show_config
    from train_recipes.cli.preflight import run_preflight
    from train_recipes.data.direct_inputs import resolve_inputs

    recipe, config = load_recipe_config(args.recipe, args.config, _overrides(args))
    # Checked as a launch would use it (converted, found in the Hub cache); shown as given.
    resolved = resolve_inputs(config)
    config, notes = _run_defaults(args, recipe, config, model_dir=resolved.model.path)
    resolved, _ = _run_defaults(args, recipe, resolved)
    nproc = args.nproc_per_node
    checked = run_preflight(resolved, world_size=nproc, local_world_size=nproc)
    notes += _data_report(resolved)
    rows = [("launch", _launch_line(args, recipe)), ("run folder", _folder_state(args, config))]
    print(show_config(recipe, config, checked.plan, rows, notes))
    for warning in checked.warnings:
        print(f"train-recipes config show: warning: {warning}", file=sys.stderr)
    return 0


def _launch_line(args: argparse.Namespace, recipe: str) -> str:
    """The launch ``train-recipes RECIPE`` makes with ``config show``'s arguments."""
    words = [f"--config {shlex.quote(str(args.config))}"] if args.config is not None else []
    words += [f"--set {shlex.quote(item)}" for item in _overrides(args)]
    words += ["--overwrite"] if args.overwrite else []
    command = " ".join([recipe, *words])
    if args.nproc_per_node == 1:
        return f"train-recipes {command}  (1 rank, in this process)"
    return (
        f"torchrun --standalone --nproc-per-node {args.nproc_per_node} -m train_recipes.cli "
        f"{command}"
    )


def _folder_state(args: argparse.Namespace, config: Any) -> str:
    """Whether a fresh launch may use ``train.output_dir``, as the launch will check it."""
    from train_recipes.run.folder import RunFolderError, check_output_dir

    out = config.train.output_dir
    try:
        check_output_dir(out, resume=False, overwrite=args.overwrite)
    except RunFolderError as err:
        return f"{out}: used; {err}"
    return f"{out}: {'cleared first (--overwrite)' if args.overwrite else 'free'}"


def _export(args: argparse.Namespace) -> int:
    from train_recipes.export.command import export_checkpoint

    logging.basicConfig(level=logging.WARNING, format="train-recipes export: %(message)s")
    try:
        written = export_checkpoint(args.checkpoint, args.out)
    except FileNotFoundError as err:
        print(f"train-recipes export: {err}", file=sys.stderr)
        return 2
    print(written)
    return 0


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML config, or the name of a shipped one (`config ls`); default: the embedded demo",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="dotted override, e.g. optim.lr=2e-5 (repeatable)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="M",
        help="shorthand for --set model.path=M: a model folder, or a Hub id (ORG/NAME) in the "
        "local Hugging Face cache",
    )
    p.add_argument(
        "--data",
        default=None,
        metavar="D",
        help="shorthand for --set data.path=D: a prepared Energon dataset, a chat JSONL, a "
        "Parquet file or a datasets.save_to_disk folder (converted once, cached)",
    )
    p.add_argument("--output-dir", default=None, help="shorthand for --set train.output_dir=DIR")
    p.add_argument(
        *NPROC_FLAGS,
        dest="nproc_per_node",
        type=int,
        default=None,
        help="local ranks started through torch's elastic launcher (torchrun); default the "
        f"config's launch.nproc_per_node, else 1 ({DEMO_RANKS} for the embedded sft demo)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a used --output-dir: delete the old run's files first (only a "
        "run's own files; anything else in the folder is refused)",
    )


def _add_recipe_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    schema: type,
    *,
    help: str,
) -> argparse.ArgumentParser:
    """A recipe's command with the run arguments and every key of ``schema`` in its help.

    It has no handler: ``main`` launches the recipe.
    """
    from train_recipes.config.key_help import keys_help

    recipe = commands.add_parser(
        name,
        help=help,
        epilog=keys_help(schema),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_train_args(recipe)
    recipe.set_defaults(handler=None)
    return recipe


def build_parser() -> argparse.ArgumentParser:
    """The ``train-recipes`` argument parser with every command."""
    parser = argparse.ArgumentParser(prog="train-recipes", description=__doc__)
    parser.add_argument("--version", action="version", version=version("train-recipes"))
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser(
        "versions", help="show the pinned library versions and the installed ones"
    )
    show.set_defaults(handler=_versions)

    from train_recipes.config.retrieval import RetrievalConfig
    from train_recipes.config.sft import SFTConfig

    sft = _add_recipe_command(
        commands, "sft", SFTConfig, help="supervised fine-tuning (no --config: the embedded demo)"
    )
    sft.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    sft.add_argument(
        "--controller",
        choices=("spmd", "ray"),
        default="spmd",
        help="spmd: torchrun ranks (default); ray: this process drives one Ray actor per rank "
        "(extra train-recipes[ray]; --nproc-per-node is then the number of ranks in all)",
    )
    sft.add_argument(
        "--ray-address",
        default=None,
        help="with --controller ray: join this Ray cluster (e.g. 'auto' after `ray start "
        "--head`, or HEAD:6379) instead of starting a local one",
    )
    _add_recipe_command(
        commands, "retrieval", RetrievalConfig, help="bi-encoder contrastive fine-tuning (InfoNCE)"
    )

    demo = commands.add_parser(
        "demo-data", help="write the embedded demo dataset in Energon format"
    )
    demo.add_argument("out", type=Path, help="output folder")
    demo.add_argument("--task", choices=("addition", "reverse"), default="addition")
    demo.add_argument("--train-size", type=int, default=20000)
    demo.add_argument("--eval-size", type=int, default=200)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=_demo_data)

    plot = commands.add_parser("plot", help="draw the loss curve of a run (PNG)")
    plot.add_argument("run", type=Path, help="run directory or its metrics.jsonl")
    plot.add_argument("--out", type=Path, default=None, help="PNG path (default <run>/loss.png)")
    plot.set_defaults(handler=_plot)

    config = commands.add_parser(
        "config", help="the shipped configs: list, copy, and show a resolved one (dry run)"
    )
    config_commands = config.add_subparsers(dest="config_command", required=True)
    ls = config_commands.add_parser("ls", help="list the configs shipped with train-recipes")
    ls.set_defaults(handler=_config_ls)
    cp = config_commands.add_parser("cp", help="copy a shipped config to edit it")
    cp.add_argument("name", help="a name from `config ls` (the .yaml may be left out)")
    cp.add_argument("dest", type=Path, help="the file to write, or a folder to write it into")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file")
    cp.set_defaults(handler=_config_cp)
    show = config_commands.add_parser(
        "show",
        help="validate a config and print it resolved, with the device plan (the dry run)",
    )
    _add_train_args(show)
    show.add_argument(
        "--recipe",
        choices=("sft", "retrieval"),
        default=None,
        help="the recipe the config is for (default: the one whose keys it uses; sft)",
    )
    show.set_defaults(handler=_config_show)

    export = commands.add_parser("export", help="write a checkpoint as a Hugging Face model")
    export.add_argument(
        "checkpoint",
        type=Path,
        help="a run folder (its newest complete checkpoint) or <run>/checkpoints/step_NNNNNN",
    )
    export.add_argument("--out", type=Path, default=None, help="default <checkpoint>/hf_model")
    export.set_defaults(handler=_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a user mistake, in one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.handler is None:
        try:
            return _train(args, argv)
        except KeyboardInterrupt:  # Ctrl-C outside the training loop's trap: no traceback
            if os.environ.get("RANK", "0") == "0":
                hint = "; continue with --resume" if args.command == "sft" else ""
                print(
                    f"\ntrain-recipes {args.command}: stopped by SIGINT outside the training "
                    f"loop{hint}",
                    file=sys.stderr,
                )
            return 130
    from train_recipes.cli.config_commands import UsageError
    from train_recipes.config.loader import ConfigError

    try:
        return int(args.handler(args))
    except (ConfigError, UsageError) as err:
        name = " ".join(filter(None, [args.command, getattr(args, "config_command", None)]))
        print(f"train-recipes {name}: {err}", file=sys.stderr)
        return 2

