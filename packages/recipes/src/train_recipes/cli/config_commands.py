"""Discoverable configs: the YAML files shipped in the wheel, ``config ls|cp|show``, key help.

The example configs live in the package (``train_recipes/configs/*.yaml``), so they are there
after ``pip install``; ``--config NAME`` accepts a shipped name where no such file exists.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Literal

import yaml

from train_recipes.cli.preflight import DevicePlan
from train_recipes.config.dpo import DPOConfig
from train_recipes.config.grpo import GRPOConfig
from train_recipes.config.key_help import config_keys
from train_recipes.config.loader import ConfigError, leaf_keys, load_config, read_tree, to_dict
from train_recipes.config.retrieval import RetrievalConfig
from train_recipes.config.sft import SFTConfig

Recipe = Literal["sft", "retrieval", "dpo", "grpo"]
#: A config of a recipe ``config`` shows.
RecipeConfig = SFTConfig | RetrievalConfig | DPOConfig | GRPOConfig


class UsageError(ValueError):
    """A command-line mistake outside the config (a missing run folder, an unknown name).

    The CLI prints it as one line and exits 2.
    """


RECIPES: dict[
    Recipe, type[SFTConfig] | type[RetrievalConfig] | type[DPOConfig] | type[GRPOConfig]
] = {
    "sft": SFTConfig,
    "retrieval": RetrievalConfig,
    "dpo": DPOConfig,
    "grpo": GRPOConfig,
}


# ----------------------------------------------------------------------------- shipped files


def shipped_configs() -> dict[str, Traversable]:
    """The example configs in the installed package, by file name (``demo-cpu.yaml``, ...)."""
    folder = files("train_recipes") / "configs"
    return {
        p.name: p
        for p in sorted(folder.iterdir(), key=lambda p: p.name)
        if p.name.endswith(".yaml")
    }


def _shipped(name: str) -> Traversable | None:
    shipped = shipped_configs()
    return shipped.get(name) or shipped.get(f"{name}.yaml")


def resolve_config_path(path: Path) -> Path:
    """``path`` itself when it exists, else the shipped config of that name (``demo-cpu``).

    Raises:
        ConfigError: neither a file nor a shipped name (key ``--config``), listing the names.
    """
    if path.is_file():
        return path
    found = _shipped(str(path)) if path.parent == Path(".") else None
    if found is not None:
        return Path(str(found))
    names = ", ".join(n.removesuffix(".yaml") for n in shipped_configs())
    raise ConfigError(
        "--config",
        f"{path} does not exist and is not a shipped config ({names}); "
        "see `train-recipes config ls`",
    )


def header(text: str) -> str:
    """The first sentence of a config's leading comment: what the config is for.

    The comment's first paragraph runs until a blank comment line or an indented one (the
    example command lines).
    """
    words: list[str] = []
    for line in text.splitlines():
        body = line[1:] if line.startswith("#") else None
        if body is None or not body.strip() or body.startswith("   "):
            break
        words.extend(body.split())
    paragraph = " ".join(words)
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


def infer_recipe(path: Path | None) -> Recipe:
    """The recipe a YAML file is for: the one whose schema accepts its keys (sft when both do).

    Raises:
        ConfigError: neither schema accepts the file; the error is the one of the recipe that
            knows more of its keys (the likelier intent).
    """
    if path is None:
        return "sft"
    errors: dict[Recipe, ConfigError] = {}
    for recipe, cls in RECIPES.items():
        try:
            load_config(cls, path)
        except ConfigError as err:
            if err.key == "--config":  # unreadable: the same for both
                raise
            errors[recipe] = err
            continue
        return recipe
    tree = yaml.safe_load(path.read_text()) or {}
    known = {
        recipe: len(leaf_keys(tree) & {doc.key for doc in config_keys(RECIPES[recipe])})
        for recipe in RECIPES
    }
    raise errors[max(RECIPES, key=known.__getitem__)]  # the first (sft) on a tie


def load_recipe_config(
    recipe: Recipe | None, path: Path | None, overrides: Sequence[str]
) -> tuple[Recipe, RecipeConfig]:
    """Resolve ``--config`` (a file or a shipped name), pick the recipe, load with overrides.

    Raises:
        ConfigError: naming the key or option at fault.
    """
    resolved = None if path is None else resolve_config_path(path)
    chosen = recipe or infer_recipe(resolved)
    return chosen, load_config(RECIPES[chosen], resolved, overrides)


def given_keys(path: Path | None, overrides: Sequence[str]) -> set[str]:
    """The dotted keys a command line sets: those of its config file and of its overrides.

    Raises:
        ConfigError: naming the option at fault (an unreadable file, a bad override).
    """
    resolved = None if path is None else resolve_config_path(path)
    return leaf_keys(read_tree(resolved, overrides))


# ---------------------------------------------------------------------------------- commands


def list_configs() -> str:
    """``config ls``: one line per shipped config (name, recipe, what it is for)."""
    rows = []
    for name, item in shipped_configs().items():
        recipe = infer_recipe(Path(str(item)))
        rows.append(f"  {name:<22} {recipe:<10} {header(item.read_text())}")
    return "\n".join(
        ["shipped configs (copy one with `train-recipes config cp NAME DEST`):", *rows]
    )


def copy_config(name: str, dest: Path, *, force: bool = False) -> Path:
    """``config cp``: write a shipped config to ``dest`` (a file, or a folder to put it in).

    Raises:
        UsageError: an unknown name (listing the known ones) or an existing target.
    """
    found = _shipped(name)
    if found is None:
        names = ", ".join(shipped_configs())
        raise UsageError(f"{name!r} is not a shipped config; choose one of: {names}")
    target = dest / found.name if dest.is_dir() else dest
    if target.exists() and not force:
        raise UsageError(f"{target} exists; pick another path or pass --force")
    target.parent.mkdir(parents=True, exist_ok=True)
    with found.open("rb") as src, target.open("wb") as out:
        shutil.copyfileobj(src, out)
    return target


# How ``describe_plan`` names a data-parallel choice that is not a wrapper's name.
_WRAPPING = {"none": "none (the model as is: one rank, no DDP or FSDP2)"}


def describe_plan(recipe: Recipe, plan: DevicePlan) -> str:
    """The device plan as ``config show`` and the dry run print it."""
    where = (
        f"{plan.local_ranks} local (torch's elastic launcher)"
        if plan.local_ranks > 1
        else "1 (this process)"
    )
    if plan.ranks != plan.local_ranks:
        where = f"{plan.ranks} in all, {plan.local_ranks} on this node"
    rows = [
        ("recipe", recipe),
        ("ranks", where),
        ("mesh", f"dp={plan.dp} x cp={plan.cp} x tp={plan.tp}"),
        ("wrapping", _WRAPPING.get(plan.data_parallel, plan.data_parallel)),
        (
            "device",
            f"{plan.device} ({plan.backend}); {plan.cuda_devices} CUDA device(s) visible here",
        ),
        ("attention", plan.attention),
    ]
    return "\n".join(f"{name:<12} {value}" for name, value in rows)


def show_config(
    recipe: Recipe,
    config: RecipeConfig,
    plan: DevicePlan,
    rows: Sequence[tuple[str, str]] = (),
    notes: Sequence[str] = (),
) -> str:
    """``config show``: the resolved config as YAML, then the device plan.

    Args:
        recipe: the recipe the config is for.
        config: the resolved config.
        plan: the device plan of the preflight.
        rows: more ``(name, value)`` rows of the plan (the launch, the run folder).
        notes: the pre-launch notes (defaults chosen, the data report), one per line.
    """
    text = yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=None, width=100)
    plan_lines = describe_plan(recipe, plan).splitlines()
    plan_lines += [f"{name:<12} {value}" for name, value in rows]
    # Comments, so that the output is itself a config file (`config show > my.yaml`).
    return "\n".join(
        [text.rstrip(), "", "# plan (validated; nothing was started):"]
        + [f"#   {line}" for line in plan_lines]
        + [f"# {note}" for note in notes]
    )
