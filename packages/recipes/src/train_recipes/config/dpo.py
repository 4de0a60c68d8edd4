"""The DPO recipe's config schema (offline preference tuning).

Pure Python (no torch import). The model, optimizer, parallelism and LoRA sections are the SFT
recipe's (the policy is built by the same code, from :func:`policy_config`); the data, train
and loss sections are DPO's own. Checks before launch: :func:`validate_dpo`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from train_recipes.config.loader import ConfigError
from train_recipes.config.sft import (
    DataConfig,
    LoRAConfig,
    ModelConfig,
    SFTConfig,
    TrainConfig,
)
from train_recipes.config.shared import LaunchConfig, OptimConfig, ParallelConfig

__all__ = [
    "DPOConfig",
    "DPODataConfig",
    "DPOLossConfig",
    "DPOTrainConfig",
    "policy_config",
    "validate_dpo",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class DPODataConfig:
    """Preference pairs.

    Attributes:
        path: a JSONL file of pairs, one per line: ``{"prompt": [chat messages, ending with a
            user turn], "chosen": "answer text", "rejected": "answer text"}``, optionally with
            ``"ref_chosen_logp"`` and ``"ref_rejected_logp"`` (the reference model's summed
            answer log-probs; when every row has both, no reference model is built). None
            builds the demo's pairs from ``demo`` (see ``train_recipes.dpo.demo_pairs``).
        eval_path: held-out chats for exact match (``{"messages": [..., assistant answer]}``
            rows); None: the demo's held-out questions when ``path`` is None, else none.
        demo: the demo task of ``path`` None (two-digit additions).
        demo_pairs: pairs the demo builds: the right answer against the policy's own greedy
            answer where that is wrong, else against a near miss.
        demo_eval_size: held-out demo questions (the SFT demo's split: never trained on).
        max_length: tokens of prompt + answer; a longer pair is refused before launch.
        micro_batch_size: pairs per data-parallel rank per micro-batch (both answers of a pair
            are rows of the same micro-batch).
        shuffle: draw the pairs in a seeded random order (each epoch reshuffled).
        packing: not supported by the DPO recipe (refused before launch).
        chat_template: as the SFT recipe's ``data.chat_template``.
    """

    path: str | None = None
    eval_path: str | None = None
    demo: Literal["addition"] = "addition"
    demo_pairs: int = 2000
    demo_eval_size: int = 200
    max_length: int = 32
    micro_batch_size: int = 16
    shuffle: bool = True
    packing: bool = False
    chat_template: str | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class DPOLossConfig:
    """The preference loss.

    Attributes:
        loss_type: "sigmoid" (DPO, Rafailov et al. 2023: -log sigmoid of beta times the
            policy's log-ratio margin over the reference's) or "simpo" (reference-free SimPO,
            Meng et al. 2024: the margin of length-normalised log-probs minus ``simpo_gamma``;
            no reference model).
        beta: the inverse temperature of the implicit reward.
        label_smoothing: the assumed rate of flipped labels (conservative DPO), in [0, 0.5).
        simpo_gamma: SimPO's target reward margin.
        nll_weight: adds this times the chosen answer's mean token negative log-likelihood
            to each pair's loss (RPO; TRL's ``rpo_alpha``); 0 is plain DPO / SimPO.
    """

    loss_type: Literal["sigmoid", "simpo"] = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    nll_weight: float = 0.0


@dataclass(kw_only=True, slots=True, frozen=True)
class DPOTrainConfig:
    """The DPO training loop (the fields mean what the SFT recipe's ``train`` keys mean)."""

    steps: int = 100
    gradient_accumulation_steps: int = 1
    seed: int = 0
    output_dir: str = "runs/dpo"
    log_every: int = 10
    loss_window: int = 20
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    device: Literal["auto", "cpu", "cuda"] = "auto"
    eval_samples: int = 200
    eval_max_new_tokens: int = 6
    export: bool = True
    tensorboard: bool = True


@dataclass(kw_only=True, slots=True, frozen=True)
class DPOConfig:
    """Offline preference tuning of a causal LM (DPO or SimPO) through the Engine."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DPODataConfig = field(default_factory=DPODataConfig)
    loss: DPOLossConfig = field(default_factory=DPOLossConfig)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-5, warmup_steps=5, min_lr_ratio=0.1)
    )
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: DPOTrainConfig = field(default_factory=DPOTrainConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def policy_config(config: DPOConfig) -> SFTConfig:
    """The SFT view of ``config`` that builds the policy and saves checkpoints.

    The policy is built, wrapped and checkpointed by the SFT recipe's code; this is the
    config that code reads.
    """
    train = config.train
    return SFTConfig(
        model=config.model,
        data=DataConfig(
            path=config.data.path,
            max_length=config.data.max_length,
            micro_batch_size=config.data.micro_batch_size,
            shuffle=config.data.shuffle,
            chat_template=config.data.chat_template,
        ),
        optim=config.optim,
        parallel=config.parallel,
        train=TrainConfig(
            steps=train.steps,
            gradient_accumulation_steps=train.gradient_accumulation_steps,
            seed=train.seed,
            output_dir=train.output_dir,
            log_every=train.log_every,
            loss_window=train.loss_window,
            checkpoint_every=train.checkpoint_every,
            keep_checkpoints=train.keep_checkpoints,
            device=train.device,
            eval_samples=train.eval_samples,
            eval_max_new_tokens=train.eval_max_new_tokens,
            export=train.export,
            tensorboard=train.tensorboard,
        ),
        lora=config.lora,
        launch=config.launch,
    )


def validate_dpo(config: DPOConfig, *, world_size: int) -> None:
    """What the DPO recipe refuses before launch, each in one line naming the key.

    Raises:
        ConfigError: the first refused key.
    """
    data, loss, parallel, train = config.data, config.loss, config.parallel, config.train
    if data.packing:
        raise ConfigError(
            "data.packing",
            "the DPO recipe does not pack rows (a pair's two answers are two rows of one "
            "micro-batch); set data.packing=false",
        )
    if parallel.cp != 1:
        raise ConfigError(
            "parallel.cp", f"is {parallel.cp}; the DPO recipe runs at cp=1 only, set parallel.cp=1"
        )
    if parallel.tp != 1:
        raise ConfigError(
            "parallel.tp", f"is {parallel.tp}; the DPO recipe runs at tp=1 only, set parallel.tp=1"
        )
    if config.model.backend != "hf":
        raise ConfigError(
            "model.backend", f"{config.model.backend!r} is not supported by dpo; use 'hf'"
        )
    if parallel.data_parallel == "none" and world_size > 1:
        raise ConfigError(
            "parallel.data_parallel",
            f"'none' runs on one rank, got {world_size}; use 'ddp' or 'fsdp2'",
        )
    if not loss.beta > 0:
        raise ConfigError("loss.beta", f"must be > 0, got {loss.beta}; e.g. loss.beta=0.1")
    if loss.nll_weight < 0:
        raise ConfigError("loss.nll_weight", f"must be >= 0, got {loss.nll_weight}")
    if not 0.0 <= loss.label_smoothing < 0.5:
        raise ConfigError(
            "loss.label_smoothing", f"must be in [0, 0.5), got {loss.label_smoothing}"
        )
    for key, value in (
        ("train.steps", train.steps),
        ("train.gradient_accumulation_steps", train.gradient_accumulation_steps),
        ("train.log_every", train.log_every),
        ("data.micro_batch_size", data.micro_batch_size),
        ("data.max_length", data.max_length),
        ("data.demo_pairs", data.demo_pairs),
    ):
        if value < 1:
            raise ConfigError(key, f"must be >= 1, got {value}")
    for key, path in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(key, f"{path} is not a file; give a JSONL file of rows")
    if config.model.path is not None and not Path(config.model.path).is_dir():
        hint = (
            "; the demo starts from a briefly SFT-trained model: run `train-recipes sft --config "
            "demo-cpu --set train.steps=500 --output-dir runs/demo-sft` first"
            if data.path is None
            else ""
        )
        raise ConfigError("model.path", f"{config.model.path} is not a model folder{hint}")
