"""The ``train-recipes`` command line: its arguments, and the commands that do not train.

The training commands (``sft``, ``retrieval``) are launched by :mod:`train_recipes.cli.launch`,
``grpo`` by :mod:`train_recipes.cli.grpo_launch`, ``dpo`` by :mod:`train_recipes.cli.dpo_command`.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.requirements import Requirement

from train_recipes.cli.launch import (
    DEMO_RANKS,
    NPROC_FLAGS,
    data_report_lines,
    overrides,
    run_defaults,
    train,
)
from train_recipes.run.launch_env import is_rank_zero

if TYPE_CHECKING:
    from train_recipes.cli.config_commands import RecipeConfig

# The library packages whose versions this distribution pins exactly.
COMPONENTS = ("train-engine", "cp-sharder", "moe-dispatch", "vocab-parallel", "energon-sft")


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
    from train_recipes.config.dpo import DPOConfig
    from train_recipes.config.grpo import GRPOConfig
    from train_recipes.data.direct_inputs import resolve_inputs

    recipe, config = load_recipe_config(args.recipe, args.config, overrides(args))
    if isinstance(config, (DPOConfig, GRPOConfig)):
        from train_recipes.cli.dpo_command import dpo_plan
        from train_recipes.cli.grpo_launch import grpo_plan

        nproc = args.nproc_per_node or config.launch.nproc_per_node or 1
        if isinstance(config, DPOConfig):
            plan = dpo_plan(config, nproc=nproc)
        else:
            plan = grpo_plan(config, nproc=nproc)
        rows = [("launch", _launch_line(args, recipe)), ("run folder", _folder_state(args, config))]
        print(show_config(recipe, config, plan, rows))
        return 0
    # Checked as a launch would use it (converted, found in the Hub cache); shown as given.
    resolved = resolve_inputs(config)
    config, notes = run_defaults(args, recipe, config, model_dir=resolved.model.path)
    resolved, _ = run_defaults(args, recipe, resolved)
    nproc = args.nproc_per_node
    checked = run_preflight(resolved, world_size=nproc, local_world_size=nproc)
    notes += data_report_lines(resolved)
    rows = [("launch", _launch_line(args, recipe)), ("run folder", _folder_state(args, config))]
    print(show_config(recipe, config, checked.plan, rows, notes))
    for warning in checked.warnings:
        print(f"train-recipes config show: warning: {warning}", file=sys.stderr)
    return 0


def _launch_line(args: argparse.Namespace, recipe: str) -> str:
    """The launch ``train-recipes RECIPE`` makes with ``config show``'s arguments."""
    words = [f"--config {shlex.quote(str(args.config))}"] if args.config is not None else []
    words += [f"--set {shlex.quote(item)}" for item in overrides(args)]
    words += ["--overwrite"] if args.overwrite else []
    command = " ".join([recipe, *words])
    if args.nproc_per_node == 1:
        return f"train-recipes {command}  (1 rank, in this process)"
    return (
        f"torchrun --standalone --nproc-per-node {args.nproc_per_node} -m train_recipes.cli "
        f"{command}"
    )


def _folder_state(args: argparse.Namespace, config: RecipeConfig) -> str:
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

    from train_recipes.config.dpo import DPOConfig
    from train_recipes.config.grpo import GRPOConfig
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
    grpo = _add_recipe_command(
        commands,
        "grpo",
        GRPOConfig,
        help="GRPO/PPO policy update from rollouts (sampled on the ranks, or a rollout file)",
    )
    grpo.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    grpo.add_argument(
        "--controller",
        choices=("spmd", "ray"),
        default="spmd",
        help="spmd: the ranks sample and update in lock-step (default); ray: not supported yet",
    )
    dpo = _add_recipe_command(
        commands,
        "dpo",
        DPOConfig,
        help="offline preference tuning: sigmoid DPO or SimPO on {prompt, chosen, rejected} pairs",
    )
    dpo.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")

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
        choices=("sft", "retrieval", "dpo", "grpo"),
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
    if args.command == "grpo":
        from train_recipes.cli.grpo_launch import launch_grpo

        return launch_grpo(args, argv)
    if args.command == "dpo":
        from train_recipes.cli.dpo_command import run_dpo_command

        return run_dpo_command(args, argv)
    if args.handler is None:
        try:
            return train(args, argv)
        except KeyboardInterrupt:  # Ctrl-C outside the training loop's trap: no traceback
            if is_rank_zero():
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
