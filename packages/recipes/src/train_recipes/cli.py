"""The ``train-recipes`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train-recipes", description=__doc__)
    parser.add_argument("--version", action="version", version=version("train-recipes"))
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser(
        "versions", help="show the pinned library versions and the installed ones"
    )
    show.set_defaults(handler=_versions)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
