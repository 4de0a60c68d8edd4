"""Validation of the recipe configs: the checks that combine several keys, paths and the world size.

Pure Python (the model-family check asks energon-sft's registry): a config is rejected, naming
the offending key, before any process group starts or any process is launched. Single values
are range-checked first, in :mod:`train_recipes.config.ranges`.
"""

from __future__ import annotations

from pathlib import Path

from train_engine import DDPConfig, FSDP2Config
from train_recipes.config.loader import ConfigError
from train_recipes.config.ranges import check_retrieval_ranges, check_sft_ranges
from train_recipes.config.retrieval import RetrievalConfig
from train_recipes.config.sft import SFTConfig, TrainConfig
from train_recipes.config.shared import ParallelConfig

__all__ = ["validate_retrieval", "validate_sft"]


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
    if parallel.data_parallel != "ddp" and parallel.ddp != DDPConfig():
        raise ConfigError(
            "parallel.ddp",
            f"DDP knobs are set but parallel.data_parallel={parallel.data_parallel!r}",
        )
    if parallel.data_parallel == "none":
        _check_no_wrapper(parallel, world_size)
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


def _check_no_wrapper(parallel: ParallelConfig, world_size: int) -> None:
    """``data_parallel: none`` uses the model as is: one rank, so no cp/tp/ep and no FSDP2."""
    if world_size != 1:
        raise ConfigError(
            "parallel.data_parallel",
            f"'none' (the model as is, no wrapper) needs a job of one rank, got {world_size} "
            f"ranks; use ddp or fsdp2 for {world_size} ranks",
        )
    if parallel.fsdp != FSDP2Config():
        raise ConfigError(
            "parallel.fsdp",
            "FSDP2 knobs are set but parallel.data_parallel='none' (no wrapper); remove "
            "parallel.fsdp, or use data_parallel=fsdp2",
        )
    for name in ("cp", "tp", "ep"):
        if getattr(parallel, name) != 1:
            raise ConfigError(
                f"parallel.{name}",
                f"parallel.data_parallel='none' runs one rank, so {name} must be 1, got "
                f"{getattr(parallel, name)}; use ddp or fsdp2 for several ranks",
            )


def _dp_size(parallel: ParallelConfig, world_size: int) -> int:
    """The data-parallel size: the ranks left over by cp and tp (1 when they take them all)."""
    return world_size // (parallel.cp * parallel.tp) or 1


def _family_takes_images(model_family: str) -> bool:
    """Ask energon-sft's family adapter (text needs no import: it keeps validation fast)."""
    if model_family == "text":
        return False
    from train_recipes.data.energon_api import family_takes_images

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
    dp = _dp_size(config.parallel, world_size)
    if data.num_logical_shards is not None and data.num_logical_shards % dp:
        raise ConfigError(
            "data.num_logical_shards",
            f"{data.num_logical_shards} logical shards cannot be split evenly over "
            f"dp={dp} replicas",
        )
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
    if model.compile_memory_budget is not None and not model.compile:
        raise ConfigError(
            "model.compile_memory_budget",
            f"is {model.compile_memory_budget} but model.compile=false: the budget applies to "
            "the compiled decoder layers only; set model.compile=true or "
            "model.compile_memory_budget=null",
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
    if model.backend == "megatron":
        from train_recipes.megatron.validation import check_megatron_config

        check_megatron_config(config)
    elif config.parallel.tp > 1:  # the megatron backend shards Megatron's own layers
        _check_tensor_parallel(config)
    _check_loop(config, world_size)
    from train_recipes.model.moe import check_moe_config

    check_moe_config(config, world_size=world_size)


def _check_loop(config: SFTConfig, world_size: int) -> None:
    """The training-loop keys: length (steps or epochs), evaluation, skips, timeouts."""
    from train_recipes.run.schedule import total_steps

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
        try:
            derived = total_steps(config, dp=_dp_size(config.parallel, world_size))
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
    if not train.signal_grace_s > 0:
        raise ConfigError(
            "train.signal_grace_s",
            f"must be > 0 seconds (the time a stop by SIGTERM/SIGINT has to save a checkpoint), "
            f"got {train.signal_grace_s}",
        )


def _check_tensor_parallel(config: SFTConfig) -> None:
    """Tp > 1: FSDP2, a model class with a TP plan, head counts divisible by tp."""
    from train_recipes.model.tensor_parallel import SUPPORTED_ARCHITECTURES, tp_head_counts

    tp, model = config.parallel.tp, config.model
    if config.parallel.data_parallel != "fsdp2":
        raise ConfigError(
            "parallel.tp",
            "tp > 1 (DTensor parameters) needs parallel.data_parallel=fsdp2; DDP does not take "
            "DTensor parameters",
        )
    if model.compile and not config.parallel.sequence_parallel:
        # Measured with torch 2.15 on CPU (aot_eager and inductor): with replicated norms the
        # backward through the compiled layers hands DTensor's Redistribute a plain tensor
        # ("'Tensor' object has no attribute '_local_tensor'"); with sequence-parallel norms
        # the compiled layers give the eager loss and gradients.
        raise ConfigError(
            "model.compile",
            "compiled decoder layers with tp > 1 and parallel.sequence_parallel=false fail in "
            "backward with torch 2.15 (DTensor's Redistribute backward gets a plain tensor); "
            "set parallel.sequence_parallel=true (the default), model.compile=false or "
            "parallel.tp=1",
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
                "train_recipes.model.tensor_parallel), or use tp=1",
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
