"""Tiny models and rank functions for the scaling tests (TP, activation checkpointing, sharded
loading, streaming export); a light module: spawned ranks re-import it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from _recipes_workers import logged_losses, metric_rows
from train_testing.tiny_hf import tiny_model

VOCAB = 101  # odd: the vocabulary shards over tp=2 are uneven (51 + 50 rows)
IMAGE_PAD, VISION_START, VISION_END = 98, 99, 100


# What differs from train_testing's tiny sizes: wider layers and the odd vocabulary.
_SIZES = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96}
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": False},  # q/k/v projections with biases
    "qwen3": {"head_dim": 16, "tie_word_embeddings": True},
    "qwen2_5_vl": {
        "vision": {"hidden_size": 32, "intermediate_size": 64},
        "image_token_id": IMAGE_PAD,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    },
}


def tiny_hf_model(
    kind: str, *, seed: int = 0, dtype: torch.dtype = torch.float64
) -> torch.nn.Module:
    """A seeded random-init transformers model of ``kind`` ("llama", "qwen2", "qwen3", "qwen2_5_vl")."""
    if kind not in _FAMILY_FIELDS:
        raise ValueError(kind)
    fields = {**_SIZES, "max_position_embeddings": 128, **_FAMILY_FIELDS[kind]}
    return tiny_model(kind, seed=seed, dtype=dtype, **fields)


def save_tiny(kind: str, directory: Path, *, seed: int = 0) -> Path:
    """save_pretrained a seeded tiny model (float32 on disk) into ``directory``."""
    tiny_hf_model(kind, seed=seed, dtype=torch.float32).save_pretrained(directory)
    return directory


def batch_for(kind: str, *, seed: int = 1, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    """Model inputs plus shifted ``labels`` [B, S] (-100 on the last position and images)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE_PAD, (2, 12), generator=gen)
    inputs: dict[str, Any] = {"input_ids": ids}
    if kind == "qwen2_5_vl":
        # One 56x56 image (4x4 patches of 14, merged 2x2: 4 placeholder tokens) in row 0.
        ids[0, 2] = VISION_START
        ids[0, 3:7] = IMAGE_PAD
        ids[0, 7] = VISION_END
        inputs["pixel_values"] = torch.randn(16, 3 * 2 * 14 * 14, generator=gen).to(dtype)
        inputs["image_grid_thw"] = torch.tensor([[1, 4, 4]])
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[(labels == IMAGE_PAD) | (labels == VISION_START)] = -100
    inputs["labels"] = labels
    return inputs


def token_sum_loss_of(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """-sum log p(label) through vocab-parallel (dense or ``Shard(-1)`` DTensor logits)."""
    from vocab_parallel import token_log_probs

    inputs = dict(batch)
    labels = inputs.pop("labels")
    logits = model(**inputs, use_cache=False).logits
    return -token_log_probs(logits, labels).sum()


def reference_token_sum_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The single-process reference: plain PyTorch token-sum cross-entropy on the model's
    materialised logits (``labels`` pre-shifted, -100 ignored), not vocab-parallel."""
    inputs = dict(batch)
    labels = inputs.pop("labels")
    logits = model(**inputs, use_cache=False).logits
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full plain tensor (DTensors gathered: collective)."""
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        assert grad is not None, f"{name} got no gradient"
        out[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return out


def tp_loss_and_grads(
    rank: int,
    world_size: int,
    kind: str,
    model_dir: str,
    sequence_parallel: bool = False,
    compiled: bool = False,
) -> dict[str, Any]:
    """Load the saved model (float64), shard it over tp=world (with sequence-parallel norms
    or not; decoder layers compiled with aot_eager or not), one forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from train_recipes.model.build import compile_decoder_layers
    from train_recipes.model.tensor_parallel import apply_tensor_parallel

    auto = AutoModelForImageTextToText if kind == "qwen2_5_vl" else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float64)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    if compiled:
        compile_decoder_layers(model, backend="aot_eager")
    layer = model.get_submodule("model.language_model" if kind == "qwen2_5_vl" else "model").layers[
        0
    ]
    residual_lengths: list[int] = []  # the residual stream's local length after layer 0
    layer.register_forward_hook(lambda _m, _a, out: residual_lengths.append(out.shape[1]))
    loss = token_sum_loss_of(model, batch_for(kind))
    loss.backward()
    return {
        "loss": float(loss.detach()),
        "grads": full_grads(model),
        "local_q_rows": layer.self_attn.q_proj.weight.to_local().shape[0],
        "residual_length": residual_lengths[0],
    }


def ac_under_fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    """Loss and gradients of a tiny Llama with checkpointed + compiled decoder layers under
    FSDP2 (float64); the test compares them with the plain model in one process."""
    from torch.distributed.device_mesh import init_device_mesh

    from train_engine import FSDP2Config, apply_data_parallel
    from train_recipes.model.activation_checkpointing import apply_activation_checkpointing
    from train_recipes.model.build import compile_decoder_layers

    torch.manual_seed(0)
    model = tiny_hf_model("llama")
    names_before = list(model.state_dict())
    checkpointed = apply_activation_checkpointing(model)
    compile_decoder_layers(model, backend="aot_eager")
    model = apply_data_parallel(
        model, mesh=init_device_mesh("cpu", (world_size,)), config=FSDP2Config()
    )
    batch = batch_for("llama", seed=10 + rank)
    loss = token_sum_loss_of(model, batch)
    loss.backward()
    return {
        "checkpointed": checkpointed,
        "names_unchanged": names_before == list(model.state_dict()),
        "loss": float(loss.detach()),
        "grads": full_grads(model),
    }


def _peak_rss_reset() -> int:
    """Reset this process's peak RSS to its current RSS (Linux clear_refs 5); returns it (KiB)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return _status_kib("VmHWM")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def sharded_load_on_rank(
    rank: int, world_size: int, kind: str, model_dir: str, layout: str, probe: list[list[int]]
) -> dict[str, Any]:
    """Meta-init ``kind`` from ``model_dir``, shard it ("fsdp2" over the world, or "tp" /
    "tp+sp" (sequence-parallel norms) over the world then a 1-rank FSDP2), load it sharded; return the gathered state, the buffers,
    the probe logits, the read statistics and the peak-RSS growth during the load."""
    from torch.distributed.device_mesh import init_device_mesh

    from train_engine import FSDP2Config, apply_data_parallel
    from train_recipes.model.loading import build_on_meta, load_sharded_safetensors
    from train_recipes.model.tensor_parallel import apply_tensor_parallel

    dims = (world_size, 1) if layout == "fsdp2" else (1, world_size)
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp", "tp"))
    model = build_on_meta(
        model_dir,
        dtype=torch.float32,
        attn_implementation="sdpa",
        image_text=kind == "qwen2_5_vl",
    )
    if layout.startswith("tp"):
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=layout == "tp+sp")
    model = apply_data_parallel(model, mesh=mesh["dp"], config=FSDP2Config())
    before = _peak_rss_reset()
    stats = load_sharded_safetensors(model, model_dir, device=torch.device("cpu"))
    peak_growth = (_status_kib("VmHWM") - before) * 1024
    state = {}
    for name, value in model.state_dict().items():
        state[name] = value.full_tensor() if hasattr(value, "full_tensor") else value
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(probe)).logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {
        "state": state if rank == 0 else {},
        "buffers": buffers if rank == 0 else {},
        "logits": logits if rank == 0 else None,
        "bytes_read": stats.bytes_read,
        "file_bytes": stats.file_bytes,
        "peak_growth": peak_growth,
    }


def save_medium_llama(directory: Path) -> Path:
    """A ~35M-parameter float32 Llama (~140 MB on disk): large enough for the load's memory
    to dominate the process's own."""
    # 8 layers of width 512 (8 heads, no grouping), a vocabulary of 8192, an untied head.
    width = {"hidden_size": 512, "intermediate_size": 1536, "vocab_size": 8192}
    depth = {"num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8}
    model = tiny_model(
        "llama", attn_implementation=None, tie_word_embeddings=False, **width, **depth
    )
    with torch.no_grad():
        model.save_pretrained(directory)
    return directory


def export_on_rank(
    rank: int, world_size: int, kind: str, model_dir: str, layout: str, out_dir: str
) -> dict[str, Any]:
    """Shard a saved model (FSDP2 over the world, or tp over the world), move its weights
    away from the saved ones, stream-export it in small shards; return its probe logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from train_engine import FSDP2Config, apply_data_parallel
    from train_recipes.export.streaming import export_streaming
    from train_recipes.model.tensor_parallel import apply_tensor_parallel

    dims = (world_size, 1) if layout == "fsdp2" else (1, world_size)
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp", "tp"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if layout == "tp":
        apply_tensor_parallel(model, mesh["tp"])
    model = apply_data_parallel(model, mesh=mesh["dp"], config=FSDP2Config())
    with torch.no_grad():  # "training": every weight changes, identically on every rank
        for param in model.parameters():
            param.mul_(1.5).add_(0.01)
    export_streaming(model, out_dir, max_shard_bytes=20_000)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 17, 33, 2, 90, 41]])).logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"logits": logits}


def lora_fsdp2_on_rank(
    rank: int, world_size: int, overrides: list[str], probe: list[list[int]], adapter_dir: str
) -> dict[str, Any]:
    """A LoRA SFT run under FSDP2 (dp or tp; merged export at the end of the run), then an adapter-only
    export; every rank joins the forwards and exports (both are collective under FSDP2)."""

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from train_recipes.config import SFTConfig, load_config, validate_sft
    from train_recipes.data.demo import build_char_tokenizer
    from train_recipes.export.hf import export_hf
    from train_recipes.model.build import build_model
    from train_recipes.sft.run import run_sft

    config = load_config(SFTConfig, None, overrides)
    validate_sft(config, world_size=world_size)
    result = run_sft(config)
    model: Any = result.model
    with torch.no_grad():
        model.eval()
        logits = model(input_ids=torch.tensor(probe)).logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    export_hf(model, build_char_tokenizer(), adapter_dir, is_main=rank == 0, lora_export="adapter")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank != 0:
        return {}
    torch.manual_seed(config.train.seed)
    fresh = build_model(config, build_char_tokenizer()).state_dict()
    prefix = "base_model.model."
    base = {
        k[len(prefix) :].replace(".base_layer", ""): v for k, v in state.items() if "lora_" not in k
    }
    return {
        "losses": logged_losses(metric_rows(config.train.output_dir)),
        "logits": logits,
        "frozen_equal": all(torch.equal(fresh[k], v) for k, v in base.items() if k in fresh),
        "compared": sum(k in fresh for k in base),
        "trainable": [n for n, p in model.named_parameters() if p.requires_grad],
        "export_dir": str(result.export_dir),
    }


def lora_model(seed: int = 0) -> torch.nn.Module:
    """The tiny float64 Llama with LoRA on every projection, both adapter matrices random (peft
    starts B at zero, which would leave A without gradient)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    model: torch.nn.Module = get_peft_model(tiny_hf_model("llama"), config)
    return model


def lora_tp_loss_and_grads(
    rank: int, world_size: int, sequence_parallel: bool = False
) -> dict[str, Any]:
    """The LoRA model sharded over tp=world: loss and the adapters' full gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    from train_recipes.model.tensor_parallel import apply_tensor_parallel

    model = lora_model()
    apply_tensor_parallel(
        model,
        init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)),
        sequence_parallel=sequence_parallel,
    )
    loss = token_sum_loss_of(model, batch_for("llama"))
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, name
            grad = param.grad
            grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return {"loss": float(loss.detach()), "grads": grads}


def packed_loss_and_grads_with_checkpointing(
    rank: int, world_size: int, cp: int, compile_backend: str | None = None
) -> dict[str, Any]:
    """The packing tests' rows (several documents per row, padding) through cp-sharder at
    ``cp`` and the recipe's token-sum loss, with every decoder layer checkpointed and without;
    the cp ranks' losses and gradients summed (as FSDP2 over the replica would). With
    ``compile_backend``, both models' layers are compiled too, nested as the recipe nests them
    for packed rows (``traced_whole=False``); two steps run, the second on recompiled graphs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from _packing_workers import packed_batch, reference_loss, tiny_model
    from cp_sharder import ContextParallelSharder
    from train_recipes.model.activation_checkpointing import checkpoint_and_compile
    from train_recipes.sft.run import token_sum_loss

    batch, rows = packed_batch("llama")
    mesh = init_device_mesh("cpu", (world_size // cp, cp), mesh_dim_names=("dp", "cp"))
    out: dict[str, Any] = {}
    for checkpointed in (False, True):
        model = tiny_model("llama")
        checkpoint_and_compile(
            model,
            checkpoint_every=1 if checkpointed else None,
            compile_layers=compile_backend is not None,
            traced_whole=False,
            backend=compile_backend or "inductor",
        )
        sharder = ContextParallelSharder(model, mesh["cp"], padding_token_id=0)
        for _ in range(2 if compile_backend is not None else 1):
            model.zero_grad(set_to_none=True)
            loss = token_sum_loss(model, batch, sharder=sharder)
            loss.backward()  # outside train_ctx, as the Engine's backward is
        total = loss.detach().clone()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if cp > 1:
            group = mesh["cp"].get_group()
            dist.all_reduce(total, group=group)
            for grad in grads.values():
                dist.all_reduce(grad, group=group)
        out["ac" if checkpointed else "plain"] = {"loss": total, "grads": grads}
    if rank != 0:
        return {}
    reference = tiny_model("llama")
    ref_loss = reference_loss(reference, rows, vlm=False)
    ref_loss.backward()
    out["reference"] = {
        "loss": ref_loss.detach(),
        "grads": {n: p.grad for n, p in reference.named_parameters() if p.grad is not None},
    }
    return out
