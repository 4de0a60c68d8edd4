"""Optional extras: whether a module is installed, and the command that installs an extra.

Every missing-extra message of the recipes goes through :func:`install_hint`, so a uv
project is told ``uv add``/``uv sync --extra`` (it has no pip) and a pip environment
``pip install``. Pure Python: the preflight uses it before any rank starts.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Literal

__all__ = [
    "Environment",
    "detect_environment",
    "install_command",
    "install_hint",
    "module_available",
]

#: Where train-recipes is installed:
#: "clone" - a uv environment of this repository's workspace (train-recipes from its sources);
#: "uv-project" - the environment of another uv project (one that depends on train-recipes);
#: "uv-venv" - a uv-made environment outside a project (``uv venv``; ``uv pip install``);
#: "pip" - any other environment.
Environment = Literal["clone", "uv-project", "uv-venv", "pip"]


def _made_by_uv(prefix: Path) -> bool:
    # uv writes its version into the pyvenv.cfg of the environments it creates, runs
    # commands with UV set, and seeds no pip.
    try:
        config = (prefix / "pyvenv.cfg").read_text(encoding="utf-8")
    except OSError:
        config = ""
    if any(line.split("=")[0].strip() == "uv" for line in config.splitlines()):
        return True
    return "UV" in os.environ or importlib.util.find_spec("pip") is None


def detect_environment(prefix: Path | None = None) -> Environment:
    """Which kind of environment ``prefix`` (default: this interpreter's) is."""
    prefix = Path(sys.prefix if prefix is None else prefix).resolve()
    if not _made_by_uv(prefix):
        return "pip"
    # A project's environment is its .venv, or elsewhere when UV_PROJECT_ENVIRONMENT names
    # it (uv then runs in the project's folder).
    owner = prefix.parent
    if "UV_PROJECT_ENVIRONMENT" in os.environ and not (owner / "pyproject.toml").is_file():
        owner = Path.cwd()
    if not (owner / "pyproject.toml").is_file():
        return "uv-venv"
    package = Path(__file__).resolve()
    return "clone" if owner.resolve() in package.parents else "uv-project"


def install_command(extra: str, environment: Environment | None = None) -> str:
    """The command that installs train-recipes' ``extra`` (e.g. "lora") where we run."""
    environment = detect_environment() if environment is None else environment
    if environment == "clone":
        # uv sync is exact: without --extra it removes the extra's packages again.
        return (
            f"uv sync --all-packages --all-groups --extra {extra} (or for one command: "
            f"uv run --extra {extra} train-recipes ...)"
        )
    if environment == "uv-project":
        return f"uv add 'train-recipes[{extra}]'"
    if environment == "uv-venv":
        return f"uv pip install 'train-recipes[{extra}]'"
    return f"pip install 'train-recipes[{extra}]'"


def install_hint(extra: str) -> str:
    """``install the extra train-recipes[X]: <command>``, the end of every missing-extra message."""
    return f"install the extra train-recipes[{extra}]: {install_command(extra)}"


def module_available(name: str) -> bool:
    """Whether ``import name`` would find the module (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder that hides it, or a broken sys.modules entry
        return False
