"""Config sections both recipes share: the optimizer and how the job is spread over ranks.

The data-parallel sections are train-engine's own :class:`~train_engine.DDPConfig` and
:class:`~train_engine.FSDP2Config` (dtypes by name, resolved when the model is wrapped), so the
typed-YAML loader reads them before any process starts and no copy has to be kept in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from train_engine import DDPConfig, FSDP2Config

__all__ = ["LaunchConfig", "OptimConfig", "ParallelConfig"]


@dataclass(kw_only=True, slots=True, frozen=True)
class LaunchConfig:
    """How the command starts the job's ranks on this machine.

    Attributes:
        nproc_per_node: local ranks to start (through torch's elastic launcher, as torchrun
            does); ``--nproc-per-node`` overrides it. None: 1, or 2 for the embedded sft
            demo (no ``--config``). Not read under a launcher you start yourself (torchrun,
            srun), whose ranks are the job.
    """

    nproc_per_node: int | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimConfig:
    """AdamW with a warm-up and a decay schedule (see ``train_recipes.run.schedule``).

    Attributes:
        lr: peak learning rate.
        weight_decay: applied to matrices only (biases and norms are excluded).
        betas: AdamW betas.
        eps: AdamW's epsilon, added to the root of the second moment (PyTorch's default).
            An update divides each gradient entry by its magnitude plus ``eps``, so entries
            near ``eps`` move by a fraction of ``lr`` that their rounding decides.
        warmup_steps: linear warm-up optimizer steps.
        min_lr_ratio: the learning rate at the last step, as a fraction of ``lr``.
        max_grad_norm: global gradient clipping threshold (> 0); None disables clipping (as in
            train_engine.Engine, which rejects 0).
        fused: use torch AdamW's fused kernel; None means on CUDA only. Fused, the Engine
            also clips and skips non-finite windows inside the kernel, without a host sync.
            Not read with master weights (MasterWeightAdamW picks its own kernel: Triton on
            CUDA, torch ops on the CPU, and always clips and skips on the device).
        master_weights: keep fp32 master weights in the optimizer (train-engine's
            MasterWeightAdamW: AdamW's fp32 update on the masters, each bf16/fp16 parameter
            rounded from its master). None: on when any trainable parameter of the wrapped
            model is bf16/fp16 (model.dtype bfloat16; FSDP2 shards, DDP, LoRA adapters alike).
            true: always (fp32 parameters are their own master). false: torch AdamW directly
            on the parameters; lossy on bf16 ones (an update below half a bf16 unit in the
            last place, 2**-9 of the weight, rounds away: most of them at lr 2e-5). A resume
            refuses a change (the optimizer state differs), except null -> false, which
            resumes a bf16 checkpoint written before this key existed (torch AdamW state).
        schedule: "linear" (warm-up, then linear decay to ``min_lr_ratio``), "cosine"
            (transformers' cosine with warm-up, down to ``min_lr_ratio``) or "constant"
            (transformers' constant with warm-up).
        nonfinite: the Engine's policy for a window with a non-finite gradient norm: "skip"
            the update, "raise" (the run fails), or "step" (update anyway).
    """

    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 30
    min_lr_ratio: float = 0.05
    max_grad_norm: float | None = 1.0
    fused: bool | None = None
    master_weights: bool | None = None
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    nonfinite: Literal["skip", "raise", "step"] = "skip"


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelConfig:
    """How the job is spread over ranks: world = dp * cp * tp.

    Attributes:
        data_parallel: "ddp", "fsdp2", or "none": the model as it is, no wrapper, for a job
            of one rank only (world size 1). On one GPU DDP and FSDP2 add nothing but copies
            (FSDP2's parameters in and gradients out each step); with model.dtype bfloat16
            and optim.master_weights (on by default then) the parameters are bf16 and the
            fp32 master weights live in the optimizer.
        cp: context-parallel degree (cp-sharder); must divide the world size.
        tp: tensor-parallel degree of the whole model (attention heads, MLP, embedding and
            output projection over the vocabulary; vocab-parallel loss). Needs fsdp2.
        ep: expert-parallel degree of converted MoE models (divides dp and the experts).
        sequence_parallel: with tp > 1, shard the residual stream and the RMSNorms over the
            sequence between the attention and MLP blocks (Megatron-SP: norms, residuals and
            checkpointed layer inputs take 1/tp of the activation memory, same traffic); rows
            are padded to a multiple of 2 * cp * tp. False keeps them replicated.
        ddp: train-engine's DDP arguments (with ``data_parallel: ddp``).
        fsdp: train-engine's FSDP2 arguments (with ``data_parallel: fsdp2``); dtypes by name
            ("bfloat16").
    """

    data_parallel: Literal["ddp", "fsdp2", "none"] = "ddp"
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = True
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDP2Config = field(default_factory=FSDP2Config)

    def data_parallel_config(self) -> DDPConfig | FSDP2Config:
        """What ``train_engine.apply_data_parallel`` takes for ``data_parallel``.

        Raises:
            ValueError: ``data_parallel`` is "none" (nothing is applied: use the model as is).
        """
        if self.data_parallel == "none":
            raise ValueError(
                "parallel.data_parallel='none' wraps nothing; use the model as it is instead "
                "of calling apply_data_parallel"
            )
        return self.ddp if self.data_parallel == "ddp" else self.fsdp
