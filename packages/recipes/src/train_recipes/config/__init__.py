"""Recipe configs: the public names, from one place.

A config is a tree of keyword-only slotted dataclasses read from YAML by the typed loader
(:mod:`train_recipes.config.loader`, with :class:`ConfigError`), in the schemas
:mod:`train_recipes.config.sft` and :mod:`train_recipes.config.retrieval` (sections both share:
:mod:`train_recipes.config.shared`), and checked by :mod:`train_recipes.config.validation`
(single values: :mod:`train_recipes.config.ranges`). Everything here is pure Python, so a config
is rejected (naming the offending key) before any process group starts.
"""

from __future__ import annotations

from train_recipes.config.loader import (
    ConfigError,
    config_from_dict,
    load_config,
    parse_override,
    to_dict,
)
from train_recipes.config.retrieval import (
    RetrievalConfig,
    RetrievalDataConfig,
    RetrievalModelConfig,
    RetrievalTrainConfig,
)
from train_recipes.config.sft import (
    DataConfig,
    LoRAConfig,
    ModelConfig,
    MoELossConfig,
    SFTConfig,
    TinyModelConfig,
    TrainConfig,
)
from train_recipes.config.shared import OptimConfig, ParallelConfig
from train_recipes.config.validation import validate_retrieval, validate_sft

__all__ = [
    "ConfigError",
    "DataConfig",
    "LoRAConfig",
    "MoELossConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RetrievalConfig",
    "RetrievalDataConfig",
    "RetrievalModelConfig",
    "RetrievalTrainConfig",
    "SFTConfig",
    "TinyModelConfig",
    "TrainConfig",
    "config_from_dict",
    "load_config",
    "parse_override",
    "to_dict",
    "validate_retrieval",
    "validate_sft",
]
