"""The SFT recipe's config schema: keyword-only slotted dataclasses, one per YAML section.

Pure Python (no torch import). Validation is in :mod:`train_recipes.config.validation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from train_recipes.config.shared import LaunchConfig, OptimConfig, ParallelConfig

__all__ = [
    "DataConfig",
    "LoRAConfig",
    "MoELossConfig",
    "ModelConfig",
    "SFTConfig",
    "TinyModelConfig",
    "TrainConfig",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class TinyModelConfig:
    """A config-only Llama-style model with random weights, for demos and tests.

    Attributes:
        hidden_size: model width H.
        num_layers: transformer blocks.
        num_heads: attention heads (H must be divisible by it).
        num_kv_heads: key/value heads (grouped-query attention); must divide num_heads.
        intermediate_size: MLP width; None means 3*H.
        tie_word_embeddings: share the input embedding with the output projection (kept
            tied under tp > 1: both are sharded over the vocabulary).
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int | None = None
    tie_word_embeddings: bool = True


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """Which model to fine-tune.

    Attributes:
        path: a local Hugging Face model directory (config, weights, tokenizer). None builds
            ``tiny`` from scratch with the demo tokenizer.
        tiny: the architecture of the random-init model used when ``path`` is None.
        dtype: parameter dtype for the forward: "float32" or "bfloat16".
        attn_implementation: passed to ``from_pretrained``/``from_config`` ("sdpa", "eager").
            With "sdpa", a Qwen2.5-VL-style vision tower runs one variable-length call per block
            (``train_recipes.model.vision_attention``) instead of transformers' per-window loop.
        compile: compile each decoder layer's forward with torch.compile (before DDP/FSDP2
            wrapping; parameter names and checkpoints are unchanged). Pays off on GPUs.
        compile_backend: the torch.compile backend of ``compile``: "inductor" (generated
            kernels), or "aot_eager" (the same graphs run by eager kernels: for debugging a
            compiled run, and fast to compile on a CPU).
        compile_memory_budget: the activation memory budget of the compiled decoder layers
            (torch's ``activation_memory_budget``, applied while these layers compile and to
            nothing else), in [0, 1]: 1 saves for backward what runs fastest, 0 what full
            recomputation would; in between, the partitioner recomputes the cheapest ops in
            backward until the saved activations fit. For a Llama layer (measured on the
            CPU) 0.66 to 0.95 recompute only the norms' outputs and the SwiGLU product (no
            matmul, no attention): a third less than at 1. ``bench/saved_activations.py`` lists
            what a value saves. None keeps torch's setting. Needs ``compile``.
        fused_loss_chunk_tokens: tokens per chunk of the fused linear loss (the loss without
            logits, used where the head allows it). One chunk's [C, V] logits are the loss's
            transient memory, alive at the end of forward with every activation (the step's
            usual peak); each chunk also reads and writes the head's whole weight gradient
            once, so fewer, larger chunks run faster. None: vocab-parallel's default, 1/20 of
            the micro batch's logits.
        fused_loss_trained_only: the fused linear loss forms only the trained positions
            (labels != -100 on this rank, after cp sharding): prompts, padding and image tokens
            (30-60% of SFT positions, ~75% of VLM ones) skip the head's three logits-sized
            matmuls, with tensor parallelism too. The same loss and gradients up to summation
            order; their count reaches the host without a sync. False: all positions.
        sdpa_backends: scaled_dot_product_attention backends to allow, in priority order
            ("cudnn", "flash", "efficient", "math"); None leaves torch's choice.
        activation_checkpointing: recompute each checkpointed decoder layer's activations in
            backward instead of keeping them (less memory, about one more forward of compute).
        activation_checkpointing_every: checkpoint decoder layers 0, k, 2k, ... (1: all).
        sharded_load: build ``path``'s model on the meta device, shard it (TP, FSDP2), then
            read from its safetensors only each rank's slices. None: on with fsdp2 and a
            ``path`` (no LoRA); false: ``from_pretrained`` on every rank.
        backend: "hf" trains the transformers model; "megatron" converts its weights into a
            megatron-core GPTModel (Llama-style models, text only, local layer spec, tp over
            Megatron's own layers; extra ``train-recipes[megatron]``).
    """

    path: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: Literal["float32", "bfloat16"] = "float32"
    attn_implementation: str = "sdpa"
    compile: bool = False
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    compile_memory_budget: float | None = None
    fused_loss_chunk_tokens: int | None = None
    fused_loss_trained_only: bool = True
    sdpa_backends: tuple[Literal["cudnn", "flash", "efficient", "math"], ...] | None = None
    activation_checkpointing: bool = False
    activation_checkpointing_every: int = 1
    sharded_load: bool | None = None
    backend: Literal["hf", "megatron"] = "hf"


@dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig:
    """Training data: a prepared Energon dataset, or a chat file converted into one.

    Attributes:
        path: a prepared Energon dataset directory (``energon-sft convert``), or a chat JSONL
            (``messages``, ShareGPT or Alpaca rows), a Parquet file or a ``datasets``
            ``save_to_disk`` folder, converted once into the cache before launch
            (``train_recipes.data.direct_inputs``). None (with ``demo``) generates the embedded demo
            dataset under ``<train.output_dir>/data``.
        demo: the embedded demo task used when ``path`` is None: "addition", "reverse" or
            "shapes" (pictures; needs ``model_family: qwen2_5_vl``).
        demo_train_size: demo training conversations.
        demo_eval_size: held-out demo conversations (exact-match accuracy is measured on them).
        eval_path: held-out chats (last message = reference answer): a JSONL of ``messages``,
            ShareGPT or Alpaca rows, a Parquet file or a ``save_to_disk`` folder; None skips
            the accuracy measurement unless the demo or ``eval_split`` provides them.
        eval_split: rows of a converted ``path`` held out for evaluation when ``eval_path``
            is None (never trained on): a fraction in (0, 1), a row count, or 0 for none;
            None: 5% of the rows, at most 200, none below 20 rows.
        model_family: energon-sft model-family adapter ("text", "qwen2_5_vl", ...).
        max_length: maximum tokens per sample after the chat template.
        micro_batch_size: samples per data-parallel rank per micro-batch.
        num_workers: Energon loader worker processes per rank.
        num_logical_shards: fixed loader shards (energon-sft); None = the dp size. A fixed
            number lets a run resume on another dp size that divides it, and makes the global
            batch independent of how it is split over dp ranks and accumulation steps.
        shuffle: shuffle the stream (False gives a repeatable order).
        packing: pack several samples into one sequence.
        train_on: "all_assistant" turns or only the "final_assistant" one.
        overlong: a row longer than ``max_length`` tokens: "truncate" (cut, trains nothing:
            weight 0), "skip" (dropped) or "error" (the run stops, naming the row). The rows
            affected are counted, not logged one by one; before launch a sample of the data
            is measured and a run that would lose most trained tokens is refused.
        chat_template: how chats are rendered into text: a named template ("chatml",
            "llama3", "zephyr"; ``train_recipes.data.chat_templates``) or the path of a Jinja
            file; None uses the tokenizer's own. A model whose tokenizer has no template
            needs it (refused before launch otherwise).
    """

    path: str | None = None
    demo: Literal["addition", "reverse", "shapes"] = "addition"
    demo_train_size: int = 20000
    demo_eval_size: int = 200
    eval_path: str | None = None
    eval_split: int | float | None = None
    model_family: str = "text"
    max_length: int = 32
    micro_batch_size: int = 32
    num_workers: int = 0
    num_logical_shards: int | None = None
    shuffle: bool = True
    packing: bool = False
    train_on: Literal["all_assistant", "final_assistant"] = "all_assistant"
    overlong: Literal["truncate", "skip", "error"] = "truncate"
    chat_template: str | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig:
    """The training loop.

    Attributes:
        steps: optimizer steps.
        gradient_accumulation_steps: micro-batches per optimizer step.
        seed: model init, data order and everything else random.
        output_dir: run directory (metrics, checkpoints, export, plots).
        log_every: optimizer steps between metric records.
        loss_window: steps averaged in ``loss_avg_window``.
        checkpoint_every: optimizer steps between checkpoints; 0 disables them.
        keep_checkpoints: how many recent checkpoints to keep; 0 keeps them all. A save
            writes the new checkpoint before the oldest is removed: the disk holds
            ``keep_checkpoints + 1`` of them at its peak.
        checkpoint_optimizer: save the optimizer's state in checkpoints (exact resumes).
            False saves the weights and the loop's state only: with AdamW and fp32 master
            weights a seventh of the size for bf16 weights. A ``--resume`` from such a
            checkpoint restarts AdamW from zero moments (and says so). Whatever this says,
            when the final checkpoint cannot be written the run tries the weights alone.
        storage_check: before launch, estimate the checkpoints' size (parameters, optimizer
            state, small per-rank state; see ``train_recipes.run.storage``) and compare the disk
            they need with the free space of ``output_dir``'s filesystem: "refuse" stops with
            one line naming both and the fix, "warn" prints that line and launches, "ignore"
            skips the check (e.g. for a filesystem that reports its free space wrongly).
        device: "auto" (CUDA when available), "cpu" or "cuda".
        eval_samples: held-out samples for the exact-match accuracy (0 disables it).
        eval_max_new_tokens: greedy decoding budget per answer.
        export: write the Hugging Face model at the end of the run.
        tensorboard: write TensorBoard event files.
        epochs: train for this many passes over the training samples instead of ``steps``
            (``steps`` must then keep its default); the step count is derived before launch.
        eval_every: optimizer steps between held-out loss evaluations (``eval/loss``), also
            run at the last step; 0 disables them. Needs held-out chats (``data.eval_path``
            or the demo's).
        eval_loss_samples: held-out chats the held-out loss is computed on.
        loggers: experiment trackers besides the metrics file: "wandb" (extra
            ``train-recipes[wandb]``) and/or "mlflow" (extra ``train-recipes[mlflow]``).
        max_consecutive_skips: abort the run after this many optimizer steps in a row were
            skipped (non-finite gradients, or no trained token), counted across resumes; 0
            never aborts.
        collective_timeout_s: a rank waiting this long for the others fails the run, naming
            the ranks that did not arrive; after the first steps the limit tightens to what
            the measured step time allows (see ``train_recipes.loop.hang_watchdog``).
        checkpoint_on_signal: on SIGTERM or SIGINT (to the launcher or the ranks) the ranks
            stop at the next step boundary, save a checkpoint of that step and exit with 143
            or 130; false: stop at once (see ``train_recipes.run.preemption``).
        signal_grace_s: seconds from the signal to a completed stop checkpoint; when they
            pass, the run stops at once (as at a second signal).
        peak_tflops: one GPU's peak TFLOPS that MFU is reported against; None takes the
            detected GPU's dense bf16 peak (H100 SXM / H200 989, A100 312, ...; see
            ``train_recipes.loop.throughput``) and reports no MFU on CPU or an unknown GPU.
    """

    steps: int = 1000
    gradient_accumulation_steps: int = 1
    seed: int = 0
    output_dir: str = "runs/sft"
    log_every: int = 25
    loss_window: int = 50
    checkpoint_every: int = 250
    keep_checkpoints: int = 2
    checkpoint_optimizer: bool = True
    storage_check: Literal["refuse", "warn", "ignore"] = "refuse"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    eval_samples: int = 200
    eval_max_new_tokens: int = 6
    export: bool = True
    tensorboard: bool = True
    epochs: int | None = None
    eval_every: int = 0
    eval_loss_samples: int = 200
    loggers: tuple[Literal["wandb", "mlflow"], ...] = ()
    max_consecutive_skips: int = 10
    collective_timeout_s: float = 600.0
    checkpoint_on_signal: bool = True
    signal_grace_s: float = 120.0
    peak_tflops: float | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class LoRAConfig:
    """Optional LoRA through peft (extra ``train-recipes[lora]``).

    Attributes:
        enabled: train LoRA adapters instead of all weights.
        r: adapter rank.
        alpha: adapter scaling numerator.
        target_modules: module names to adapt.
        export: "merged" (full model) or "adapter" (adapter weights only).
    """

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    export: Literal["merged", "adapter"] = "merged"


@dataclass(kw_only=True, slots=True, frozen=True)
class MoELossConfig:
    """Router losses of converted MoE models (see train_recipes.model.moe).

    Attributes:
        aux_loss_coef: weight of the Switch load-balancing loss, averaged over MoE layers,
            micro-batches and ranks (0 disables it).
        z_loss_coef: weight of the router z-loss, averaged the same way (0 disables it).
        bias_update_rate: DeepSeek-V3's aux-loss-free balancing: after each optimizer step the
            routers' score-correction biases move by this rate towards equal expert loads
            (DeepSeek-V3 uses 1e-3; 0 disables it; sigmoid-routed families only).
    """

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0


@dataclass(kw_only=True, slots=True, frozen=True)
class SFTConfig:
    """The SFT recipe (causal LM; VLM when ``data.model_family`` is a vision family)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    moe: MoELossConfig = field(default_factory=MoELossConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
