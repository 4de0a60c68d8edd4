"""The GRPO recipe's config schema: the policy update of GRPO/PPO from rollouts.

Pure Python (no torch import). The model, optimizer, parallelism and LoRA sections are the SFT
recipe's own (the policy is built as an SFT model is); the rollout, loss and training-loop
sections are this recipe's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from train_recipes.config.sft import (
    DataConfig,
    LoRAConfig,
    ModelConfig,
    MoELossConfig,
    SFTConfig,
    TrainConfig,
)
from train_recipes.config.shared import LaunchConfig, OptimConfig, ParallelConfig

__all__ = [
    "GRPOConfig",
    "GRPODataConfig",
    "GRPOTrainConfig",
    "PolicyLossConfig",
    "RolloutConfig",
    "policy_sft_config",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class PolicyLossConfig:
    """The per-token policy loss (``train_recipes.loss.policy_loss``).

    Per trained (completion) token t, with ratio r_t = exp(log p_t - old log p_t) and the
    token's advantage A_t::

        loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
                 + kl_coef * KL_t - entropy_coef * H_t

    summed over the step's trained tokens and divided by their global number by the Engine
    (the token-sum contract).

    Attributes:
        eps_low: lower clip of the ratio (PPO's epsilon).
        eps_high: upper clip of the ratio (DAPO's "clip higher" raises it, e.g. 0.28).
        kl_coef: weight of the KL to the reference model (0: no reference model is built).
        kl_estimator: "k1" (log p - log p_ref) or "k3" (exp(log p_ref - log p) - 1 -
            (log p_ref - log p): unbiased, never negative; GRPO's choice).
        entropy_coef: weight of the entropy bonus (the token's softmax entropy is subtracted).
        advantage_eps: added to each group's reward standard deviation before dividing.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0
    advantage_eps: float = 1e-4


@dataclass(kw_only=True, slots=True, frozen=True)
class RolloutConfig:
    """Where rollouts come from and how each batch of them is used.

    Attributes:
        source: "sampler" (the policy samples on the ranks with transformers ``generate``) or
            "file" (a rollout JSONL written by an external generator; row format in
            ``train_recipes.grpo.rollout_file``).
        path: the rollout JSONL (``source: file``).
        groups_per_batch: prompt groups per rollout batch, over all data-parallel ranks
            (a multiple of dp * minibatches).
        group_size: samples per prompt (G) for the sampler.
        temperature: sampling temperature; the policy's log-probs are those of
            softmax(logits / temperature) too.
        max_new_tokens: the sampler's completion budget.
        update_epochs: passes over each rollout batch.
        minibatches: optimizer steps per pass (the batch is split into this many parts).
    """

    source: Literal["sampler", "file"] = "sampler"
    path: str | None = None
    groups_per_batch: int = 16
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 6
    update_epochs: int = 1
    minibatches: int = 1


@dataclass(kw_only=True, slots=True, frozen=True)
class GRPODataConfig:
    """The prompts the sampler answers and the held-out questions.

    Attributes:
        prompts: a chat JSONL whose rows end with the reference assistant answer (the
            reward is exact match with it); None: the embedded addition demo's training
            questions.
        eval_path: held-out chats of the same form (exact match before and after); None with
            ``prompts`` None: the demo's held-out questions.
        demo_train_size: demo training questions (as the SFT demo's ``data.demo_train_size``:
            the held-out split is the same when this, the eval size and ``train.seed`` agree).
        demo_eval_size: demo held-out questions.
        max_length: prompt plus completion tokens at most (longer prompts are refused).
    """

    prompts: str | None = None
    eval_path: str | None = None
    demo_train_size: int = 20000
    demo_eval_size: int = 200
    max_length: int = 32


@dataclass(kw_only=True, slots=True, frozen=True)
class GRPOTrainConfig:
    """The training loop; a step is one optimizer step (see the SFT ``TrainConfig``).

    Attributes:
        steps: optimizer steps (a rollout batch gives ``update_epochs * minibatches``).
        seed: model init, prompt order and the sampler's RNG (each rank adds its rank).
        output_dir: run directory.
        log_every: steps between metric records.
        loss_window: steps averaged in ``loss_avg_window``.
        checkpoint_every: steps between checkpoints (0: none).
        keep_checkpoints: recent checkpoints kept (0: all).
        device: "auto", "cpu" or "cuda".
        eval_samples: held-out questions for exact match (0: none).
        eval_max_new_tokens: greedy decoding budget per held-out answer.
        export: write the Hugging Face model at the end.
        tensorboard: write TensorBoard event files.
    """

    steps: int = 100
    seed: int = 0
    output_dir: str = "runs/grpo"
    log_every: int = 5
    loss_window: int = 10
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    device: Literal["auto", "cpu", "cuda"] = "auto"
    eval_samples: int = 200
    eval_max_new_tokens: int = 6
    export: bool = True
    tensorboard: bool = True


@dataclass(kw_only=True, slots=True, frozen=True)
class GRPOConfig:
    """The GRPO recipe: the policy update from rollouts, on the Engine."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: GRPODataConfig = field(default_factory=GRPODataConfig)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=0, min_lr_ratio=1.0)
    )
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: GRPOTrainConfig = field(default_factory=GRPOTrainConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    moe: MoELossConfig = field(default_factory=MoELossConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def policy_sft_config(config: GRPOConfig) -> SFTConfig:
    """The SFT config that builds this run's policy (and its reference) as the SFT recipe would.

    The model, parallelism, LoRA, MoE and optimizer sections are the run's; the data and
    training keys the model builders read (``data.max_length``, ``train.seed``,
    ``train.device``, one micro-batch per step) are filled in from this recipe's.
    """
    train = config.train
    return SFTConfig(
        model=config.model,
        data=DataConfig(max_length=config.data.max_length),
        optim=config.optim,
        parallel=config.parallel,
        train=TrainConfig(
            steps=train.steps,
            seed=train.seed,
            output_dir=train.output_dir,
            device=train.device,
            eval_samples=0,
            export=train.export,
            tensorboard=train.tensorboard,
        ),
        lora=config.lora,
        moe=config.moe,
        launch=config.launch,
    )
