"""Defaults that follow the run: the demo's task-specific values never reach your own model.

``SFTConfig``'s defaults are the embedded demo's (a tiny random model learning two-digit
addition: 32-token rows, micro-batches of 32, lr 3e-3, 1,000 steps, 6-token answers). With
``model.path`` set, the keys below that the config file and the ``--set`` overrides leave
unset take fine-tuning values instead (:data:`OWN_MODEL`); a key given explicitly always
wins. The launching process prints the values chosen in one line.

Pure Python (reads the model's ``config.json``), so it runs before any rank starts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from pathlib import Path

from train_recipes.config.loader import ConfigError
from train_recipes.config.sft import SFTConfig

__all__ = [
    "EVAL_EVERY",
    "MAX_LENGTH_CAP",
    "OWN_MODEL",
    "apply_run_defaults",
    "max_position_embeddings",
]

#: ``data.max_length`` of your own model: its ``max_position_embeddings``, at most this (rows
#: are padded to the longest in their batch, so a short dataset pays nothing for it).
MAX_LENGTH_CAP = 2048

#: The defaults of a run on your own model (``model.path`` set); ``data.max_length`` is derived
#: from the model (:data:`MAX_LENGTH_CAP`) and ``optim.lr`` is :data:`LORA_LR` with LoRA.
#: Close to TRL's SFTTrainer: lr 2e-5 for full fine-tuning, 3 epochs, no warm-up.
OWN_MODEL: dict[str, int | float] = {
    "data.micro_batch_size": 4,
    "optim.lr": 2e-5,
    "optim.warmup_steps": 0,
    "train.epochs": 3,
    "train.eval_max_new_tokens": 128,
}
#: ``optim.lr`` of LoRA adapters on your own model (they start at zero and need larger steps).
LORA_LR = 2e-4
#: ``train.eval_every`` of your own model when it has held-out chats (``data.eval_path``, or
#: ``data.eval_split``'s rows of a chat file): the held-out loss before training, every this
#: many steps and at the last, so a run shows whether it generalises whatever its task (exact
#: match stays at 0% for long answers).
EVAL_EVERY = 500


def max_position_embeddings(model_dir: str | Path) -> int | None:
    """The longest sequence a model folder's ``config.json`` declares (a VLM's text config's)."""
    try:
        hf_config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for section in (hf_config, hf_config.get("text_config") or {}):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def _with(config: SFTConfig, key: str, value: object) -> SFTConfig:
    section, name = key.split(".")
    part = dataclasses.replace(getattr(config, section), **{name: value})
    return dataclasses.replace(config, **{section: part})


def apply_run_defaults(
    config: SFTConfig, given: Collection[str], *, model_dir: str | None = None
) -> tuple[SFTConfig, str | None]:
    """``config`` with the own-model defaults of the keys not in ``given``, and a line saying so.

    Args:
        config: the loaded config.
        given: the dotted keys the config file and the overrides set (they are kept).
        model_dir: the local folder of ``model.path`` when that is not one (a Hub id found in
            the cache); its config.json gives ``data.max_length``.

    Returns:
        The config, and the one line naming the values chosen (None for the demo model or
        when every key was given).

    Raises:
        ConfigError: ``data.max_length`` cannot be derived (no ``max_position_embeddings``
            in the model's config.json), or ``data.packing`` without ``train.steps`` (an epoch
            of packed rows has no fixed length).
    """
    if config.model.path is None:
        return config, None
    chosen: list[str] = []
    folder = model_dir or config.model.path
    # A folder without config.json is the preflight's to name (model.path), not this key's.
    if "data.max_length" not in given and (Path(folder) / "config.json").is_file():
        limit = max_position_embeddings(folder)
        if limit is None:
            raise ConfigError(
                "data.max_length",
                f"{folder}/config.json declares no max_position_embeddings, so the "
                f"token limit per row is unknown; set data.max_length (e.g. {MAX_LENGTH_CAP})",
            )
        length = min(limit, MAX_LENGTH_CAP)
        config = _with(config, "data.max_length", length)
        capped = f", capped at {MAX_LENGTH_CAP}" if limit > MAX_LENGTH_CAP else ""
        chosen.append(f"data.max_length={length} (max_position_embeddings {limit}{capped})")
    defaults = dict(OWN_MODEL)
    if config.lora.enabled:
        defaults["optim.lr"] = LORA_LR
    if "train.steps" in given or "train.epochs" in given:
        del defaults["train.epochs"]
    elif config.data.packing:
        raise ConfigError(
            "train.steps",
            "is needed with your own model and data.packing=true: the default length of 3 "
            "epochs has no fixed step count for packed rows; set train.steps (e.g. 1000)",
        )
    if config.data.eval_path is not None and config.train.eval_every == 0:
        defaults["train.eval_every"] = EVAL_EVERY
    for key, value in defaults.items():
        if key not in given:
            config = _with(config, key, value)
            chosen.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
    if not chosen:
        return config, None
    return config, (
        f"defaults for your own model (the demo's do not apply): {', '.join(chosen)}; "
        "set a key to change it"
    )
