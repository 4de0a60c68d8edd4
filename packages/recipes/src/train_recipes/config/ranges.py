"""Value ranges of the recipe configs: each number, string and name checked on its own.

These run first in :func:`train_recipes.config.validate_sft` / ``validate_retrieval``, before
the checks that combine several keys, so that a value which would fail late or oddly (a
``ZeroDivisionError`` for ``num_heads=0``, a silent no-op for ``log_every=0``, an optimizer that
never moves for ``lr=0``) is rejected before launch, naming its key and the accepted range.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from train_recipes.config.loader import ConfigError

if TYPE_CHECKING:
    from train_recipes.config.retrieval import RetrievalConfig, RetrievalTrainConfig
    from train_recipes.config.sft import SFTConfig, TrainConfig
    from train_recipes.config.shared import LaunchConfig, OptimConfig


def _at_least(key: str, value: int, low: int, fix: str = "") -> None:
    if value < low:
        raise ConfigError(key, f"must be >= {low}, got {value}{'; ' + fix if fix else ''}")


def _finite_above_zero(key: str, value: float, fix: str = "") -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(
            key, f"must be a finite number > 0, got {value}{'; ' + fix if fix else ''}"
        )


def check_optim(optim: OptimConfig) -> None:
    """AdamW and schedule values: finite lr > 0, betas in [0, 1), eps >= 0, clipping > 0 or None."""
    _finite_above_zero("optim.lr", optim.lr, "e.g. optim.lr=2e-5")
    for i, beta in enumerate(optim.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(
                f"optim.betas[{i}]", f"must be in [0, 1), got {beta}; AdamW's usual is [0.9, 0.95]"
            )
    if not (math.isfinite(optim.eps) and optim.eps >= 0):
        raise ConfigError(
            "optim.eps", f"must be a finite number >= 0, got {optim.eps}; AdamW's usual is 1e-8"
        )
    if not (math.isfinite(optim.weight_decay) and optim.weight_decay >= 0):
        raise ConfigError(
            "optim.weight_decay", f"must be a finite number >= 0, got {optim.weight_decay}"
        )
    _at_least("optim.warmup_steps", optim.warmup_steps, 0)
    if not 0.0 <= optim.min_lr_ratio <= 1.0:
        raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {optim.min_lr_ratio}")
    if optim.max_grad_norm is not None:
        # The Engine rejects 0 too: None is the one spelling of "no clipping".
        _finite_above_zero(
            "optim.max_grad_norm", optim.max_grad_norm, "use null to disable clipping"
        )


def check_loop(train: TrainConfig | RetrievalTrainConfig) -> None:
    """The fields both recipes' training loops share."""
    _at_least("train.log_every", train.log_every, 1)
    _at_least("train.loss_window", train.loss_window, 1)
    if not train.output_dir.strip():
        raise ConfigError(
            "train.output_dir", "is empty; name a run folder, e.g. --output-dir runs/my-run"
        )


def check_launch(launch: LaunchConfig) -> None:
    """The ``launch`` section both recipes share."""
    if launch.nproc_per_node is not None:
        _at_least(
            "launch.nproc_per_node",
            launch.nproc_per_node,
            1,
            "null: 1 rank (2 for the embedded demo); e.g. 2 for two local ranks",
        )


def check_sft_ranges(config: SFTConfig) -> None:
    """Every SFT value that is wrong on its own, whatever the other keys say."""
    check_optim(config.optim)
    check_launch(config.launch)
    train, data, tiny = config.train, config.data, config.model.tiny
    check_loop(train)
    _at_least("train.steps", train.steps, 1)
    _at_least("train.checkpoint_every", train.checkpoint_every, 0)
    _at_least("train.keep_checkpoints", train.keep_checkpoints, 0, "0 keeps every checkpoint")
    _at_least("train.eval_samples", train.eval_samples, 0, "0 disables the accuracy measurement")
    _at_least("train.eval_max_new_tokens", train.eval_max_new_tokens, 1)
    if train.peak_tflops is not None:
        _finite_above_zero(
            "train.peak_tflops", train.peak_tflops, "e.g. 989 (H100 SXM, bf16 dense); null detects"
        )
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads"):
        _at_least(f"model.tiny.{name}", getattr(tiny, name), 1)
    if tiny.intermediate_size is not None:
        _at_least("model.tiny.intermediate_size", tiny.intermediate_size, 1, "null means 3*H")
    budget = config.model.compile_memory_budget
    if budget is not None and not 0.0 <= budget <= 1.0:
        raise ConfigError(
            "model.compile_memory_budget",
            f"must be in [0, 1] (1: save what runs fastest, 0: recompute everything), got "
            f"{budget}; e.g. 0.9 recomputes only the norms and the SwiGLU product, null keeps "
            "torch's setting",
        )
    if config.model.fused_loss_chunk_tokens is not None:
        _at_least(
            "model.fused_loss_chunk_tokens",
            config.model.fused_loss_chunk_tokens,
            1,
            "null picks 1/20 of the micro batch's logits",
        )
    _at_least("data.micro_batch_size", data.micro_batch_size, 1)
    _at_least("data.max_length", data.max_length, 2)
    _at_least("data.num_workers", data.num_workers, 0, "0 loads in the training process")
    _at_least("data.demo_train_size", data.demo_train_size, 1)
    _at_least("data.demo_eval_size", data.demo_eval_size, 0)
    if data.num_logical_shards is not None:
        _at_least("data.num_logical_shards", data.num_logical_shards, 1, "null means the dp size")
    # energon-sft's registry is the one list of families (users may register their own); it
    # imports torch, which "text" (built in) does not need before launch.
    if data.model_family != "text":
        from energon_sft import known_model_families

        families = known_model_families()
        if data.model_family not in families:
            raise ConfigError(
                "data.model_family",
                f"unknown model family {data.model_family!r}; known: {families}",
            )
    _at_least("lora.r", config.lora.r, 1)
    if config.lora.alpha <= 0:
        raise ConfigError("lora.alpha", f"must be > 0, got {config.lora.alpha}")
    if config.lora.enabled and not config.lora.target_modules:
        raise ConfigError("lora.target_modules", "is empty; name the modules to adapt")


def check_retrieval_ranges(config: RetrievalConfig) -> None:
    """Every retrieval value that is wrong on its own, whatever the other keys say."""
    check_optim(config.optim)
    check_launch(config.launch)
    check_loop(config.train)
    _at_least("train.steps", config.train.steps, 1)
    _finite_above_zero("model.temperature", config.model.temperature, "e.g. 0.05")
    data = config.data
    _at_least("data.eval_size", data.eval_size, 1)
    _at_least("data.max_length", data.max_length, 2)
    _at_least("data.micro_batch_size", data.micro_batch_size, 1)
    if data.source == "stdlib_docstrings" and not data.modules:
        raise ConfigError("data.modules", "is empty; name standard-library modules to read")
