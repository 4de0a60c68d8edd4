"""The ``train-recipes`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.requirements import Requirement

if TYPE_CHECKING:
    from train_recipes.run_folder import RunLock

# The library packages whose versions this distribution pins exactly.
COMPONENTS = ("train-engine", "cp-sharder", "moe-dispatch", "vocab-parallel", "energon-sft")

# `train-recipes sft` with no config runs the embedded demo on this many local ranks.
DEMO_RANKS = 2


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


def _relaunch(nproc: int, argv: Sequence[str]) -> int:
    """Start ``nproc`` local ranks through torch's elastic launcher (torchrun's own API)."""
    from torch.distributed.run import parse_args, run

    # OMP threads: torchrun sets 1 per rank when unset; say it explicitly so a laptop's cores
    # are split between the ranks instead of oversubscribed.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    launcher = parse_args(
        ["--standalone", "--nproc-per-node", str(nproc), "--module", "train_recipes.cli", *argv]
    )
    run(launcher)
    return 0


def _strip_nproc(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == "--nproc-per-node":
            skip = True
            continue
        if item.startswith("--nproc-per-node="):
            continue
        out.append(item)
    return out


def _world_size(args: argparse.Namespace) -> int:
    if _under_launcher():
        return int(os.environ["WORLD_SIZE"])
    return int(args.nproc_per_node)


def _load(args: argparse.Namespace, kind: str) -> object:
    from train_recipes.config import (
        RetrievalConfig,
        SFTConfig,
        load_config,
        validate_retrieval,
        validate_sft,
    )

    overrides = list(args.set or [])
    if args.output_dir is not None:
        overrides.append(f"train.output_dir={args.output_dir}")
    if kind == "sft":
        sft = load_config(SFTConfig, args.config, overrides)
        validate_sft(sft, world_size=_world_size(args))
        return sft
    retrieval = load_config(RetrievalConfig, args.config, overrides)
    validate_retrieval(retrieval, world_size=_world_size(args))
    return retrieval


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
    from train_recipes.config import SFTConfig
    from train_recipes.resume import plan_resume
    from train_recipes.run_folder import RunLock, check_output_dir, clear_run

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
            if saved is not None and saved.step >= config.train.steps:
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


def _train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from train_recipes.config import ConfigError

    if _under_launcher():
        from train_recipes._dist import die_with_parent

        die_with_parent()  # a rank never outlives its launcher (no orphan keeps training)
    if args.nproc_per_node is None:
        args.nproc_per_node = DEMO_RANKS if (args.command == "sft" and args.config is None) else 1
    lock = None
    try:
        config = _load(args, args.command)
        lock, done = _guard_run_folder(args, config)
    except ConfigError as err:
        print(f"train-recipes {args.command}: {err}", file=sys.stderr)
        return 2
    try:
        if done is not None:
            return done
        if args.nproc_per_node > 1 and not _under_launcher():
            out = Path(config.train.output_dir).resolve()  # type: ignore[attr-defined]
            os.environ[_GUARDED_ENV] = str(out)
            return _relaunch(args.nproc_per_node, _strip_nproc(argv))
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
        if args.command == "sft":
            from train_recipes.config import SFTConfig
            from train_recipes.sft import run_sft

            assert isinstance(config, SFTConfig)
            run_sft(config, resume=args.resume)
        else:
            from train_recipes.config import RetrievalConfig
            from train_recipes.retrieval import run_retrieval

            assert isinstance(config, RetrievalConfig)
            run_retrieval(config)
        return 0
    finally:
        if lock is not None:
            lock.release()


def _demo_data(args: argparse.Namespace) -> int:
    from train_recipes.demo import write_demo_dataset

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
    from train_recipes.metrics import plot_loss

    print(plot_loss(args.run, args.out))
    return 0


def _export(args: argparse.Namespace) -> int:
    from train_recipes.export import export_checkpoint

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
        "--config", type=Path, default=None, help="YAML config (default: the embedded demo)"
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="dotted override, e.g. optim.lr=2e-5 (repeatable)",
    )
    p.add_argument("--output-dir", default=None, help="shorthand for --set train.output_dir=DIR")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="local ranks started through torch's elastic launcher (torchrun); default 1 "
        f"({DEMO_RANKS} for the embedded sft demo)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a used --output-dir: delete the old run's files first (only a "
        "run's own files; anything else in the folder is refused)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train-recipes", description=__doc__)
    parser.add_argument("--version", action="version", version=version("train-recipes"))
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser(
        "versions", help="show the pinned library versions and the installed ones"
    )
    show.set_defaults(handler=_versions)

    sft = commands.add_parser("sft", help="supervised fine-tuning (no --config: the embedded demo)")
    _add_train_args(sft)
    sft.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    sft.set_defaults(handler=None)

    ret = commands.add_parser("retrieval", help="bi-encoder contrastive fine-tuning (InfoNCE)")
    _add_train_args(ret)
    ret.set_defaults(handler=None)

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
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.handler is None:
        return _train(args, argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
