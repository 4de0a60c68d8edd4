"""Models and tokenizers for the SFT recipe: build, unwrap, greedy-decode, export to HF format."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from train_recipes.config import SFTConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LocalProcessor:
    """A tokenizer plus an image processor: the two parts a Qwen2.5-VL processor carries.

    Built locally for the demo VLM (no processor files to download); energon-sft's
    Qwen2.5-VL adapter reads ``.tokenizer`` and ``.image_processor``.
    """

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor

    def save_pretrained(self, directory: str | Path) -> None:
        """Write both parts into one folder (tokenizer files + preprocessor_config.json)."""
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)


def is_vlm(config: SFTConfig) -> bool:
    """The image-text path: energon-sft's adapter for ``data.model_family`` takes images."""
    from train_recipes import _integrations as data_api

    return data_api.family_takes_images(config.data.model_family)


def demo_image_processor() -> Any:
    """Qwen2-VL image processing (PIL backend: no torchvision) at the demo's image size."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from train_recipes.demo import IMAGE_SIZE

    pixels = IMAGE_SIZE * IMAGE_SIZE
    return Qwen2VLImageProcessorPil(
        min_pixels=pixels, max_pixels=pixels, patch_size=14, merge_size=2, temporal_patch_size=2
    )


def load_processor(config: SFTConfig) -> Any:
    """What energon-sft's encoder takes: the tokenizer (text) or a processor (VLM)."""
    if not is_vlm(config):
        return load_tokenizer(config)
    if config.model.path is None:
        return LocalProcessor(load_tokenizer(config), demo_image_processor())
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(config.model.path)


def tokenizer_of(processor_or_tokenizer: Any) -> Any:
    """The tokenizer inside a processor (or the tokenizer itself)."""
    return getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)


def load_tokenizer(config: SFTConfig) -> Any:
    """The model's own tokenizer (``model.path``) or the demo character tokenizer."""
    if config.model.path is None:
        from train_recipes.demo import build_char_tokenizer

        return build_char_tokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(config: SFTConfig, tokenizer: Any) -> nn.Module:
    """Load ``model.path`` or build the random-init tiny Llama from ``model.tiny``.

    Call after seeding: the tiny model's weights come from the global RNG.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    dtype = _DTYPES[config.model.dtype]
    if is_vlm(config):
        return _build_vlm(config, tokenizer, dtype)
    if config.model.path is not None:
        return AutoModelForCausalLM.from_pretrained(
            config.model.path, dtype=dtype, attn_implementation=config.model.attn_implementation
        )
    tiny = config.model.tiny
    hf_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size or 3 * tiny.hidden_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        max_position_embeddings=max(64, 2 * config.data.max_length),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=tiny.tie_word_embeddings,
    )
    hf_config._attn_implementation = config.model.attn_implementation
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers model (the classes in ``_no_split_modules``)."""
    names = set(getattr(unwrap(model), "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"found no decoder layers in {type(model).__name__}: its _no_split_modules "
            f"({sorted(names)}) names no submodule class; compile is only supported for "
            "transformers models"
        )
    return layers


def compile_decoder_layers(model: nn.Module, *, backend: str = "inductor") -> int:
    """Compile the forward of every decoder layer in place; call before FSDP2 wrapping.

    The layer's ``forward`` is compiled, not the module: parameter names stay unchanged (no
    ``_orig_mod.``), so checkpoints and the HF export are unaffected, and module hooks (FSDP2's
    all-gather and reduce-scatter) run outside the compiled region. Identical layers share one
    graph.

    Args:
        model: a transformers model (plain, not yet wrapped).
        backend: the torch.compile backend ("aot_eager" makes tests fast on the CPU).

    Returns:
        The number of layers compiled.
    """
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend)
    return len(layers)


_SDPA_BACKENDS = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


@contextlib.contextmanager
def sdpa_backends(names: Sequence[str] | None) -> Iterator[None]:
    """Restrict scaled_dot_product_attention to ``names``, tried in this order (None: torch's).

    Wrap the forward and the backward (under torch.compile, the backend is fixed when tracing).

    Args:
        names: some of "cudnn", "flash", "efficient", "math".

    Raises:
        ValueError: an unknown backend name.
    """
    if names is None:
        yield
        return
    unknown = [n for n in names if n not in _SDPA_BACKENDS]
    if unknown or not names:
        raise ValueError(
            f"unknown SDPA backends {unknown or list(names)}; choose from {sorted(_SDPA_BACKENDS)}"
        )
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [getattr(SDPBackend, _SDPA_BACKENDS[n]) for n in names]
    with sdpa_kernel(order, set_priority=True):
        yield


# Name under which the mask-free causal attention is registered with transformers.
CAUSAL_ATTENTION = "train_recipes_causal_sdpa"


def _causal_sdpa(
    module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> Any:
    """transformers' SDPA attention, called without a mask: plain causal attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        raise RuntimeError(
            f"the {CAUSAL_ATTENTION!r} attention got a mask; it is only for unpacked, unpadded-"
            "attention text batches (CausalFastPath.select(packed=True) switches back)"
        )
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def rows_are_packed(position_ids: torch.Tensor) -> bool:
    """Whether any row of ``position_ids`` [B, S] holds several documents (positions restart).

    The criterion transformers applies on the device; here it runs on the host copy.
    """
    return bool((position_ids[:, 1:] - position_ids[:, :-1] != 1).any())


def attention_path(*, packed: bool, cp: int, vlm: bool) -> str:
    """Which attention the recipe runs for this combination (for the run header and summary).

    Args:
        packed: ``data.packing`` (energon-sft's THD batches).
        cp: the context-parallel degree.
        vlm: the image-text path (the vision tower keeps its own attention).
    """
    if packed and cp > 1:
        return f"cp-sharder THD context parallelism (cp={cp}), variable-length per document"
    if packed:
        return "cp-sharder variable-length attention per document (cp=1), no mask"
    if cp > 1:
        return f"cp-sharder context parallelism (cp={cp}), causal"
    if vlm:
        return "transformers SDPA, causal, no mask"
    return "causal SDPA without mask construction (CausalFastPath)"


class CausalFastPath:
    """Run unpacked text batches through causal SDPA without transformers' mask construction.

    For a batch without a mask, transformers inspects the position ids on the device to detect
    packed rows; reading the answer back stalls the host until the GPU has finished all queued
    work (the previous optimizer step), so the GPU then waits for the host to queue the next
    forward. The recipe knows from the host copy of the batch whether rows are packed: for
    unpacked rows it switches the model to a registered attention that transformers gives no
    mask (its SDPA attention, called causal and unmasked: the same computation), and back to
    transformers' SDPA for packed rows, which need the per-document mask. While the fast path
    is selected, transformers drops 2-D padding masks before attention: select(packed=True)
    before any forward that needs one (generation, padded evaluation).

    Args:
        model: a text transformers model whose attention implementation is "sdpa" (otherwise
            :meth:`select` does nothing).
    """

    def __init__(self, model: nn.Module) -> None:
        from transformers import AttentionInterface

        self._model = unwrap(model)
        self._base = getattr(self._model.config, "_attn_implementation", None)
        self.enabled = self._base == "sdpa"
        if self.enabled:
            # Registering the same function under the same name again is harmless.
            AttentionInterface.register(CAUSAL_ATTENTION, _causal_sdpa)

    def select(self, *, packed: bool) -> None:
        """Use transformers' SDPA (packed rows) or the mask-free causal attention."""
        if not self.enabled:
            return
        target = self._base if packed else CAUSAL_ATTENTION
        config: Any = self._model.config
        if config._attn_implementation != target:
            # The config setter (what from_config's attn_implementation sets): the model's
            # layers share this config and look the attention function up on every call.
            config._attn_implementation = target


def _build_vlm(config: SFTConfig, tokenizer: Any, dtype: torch.dtype) -> nn.Module:
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )

    if config.model.path is not None:
        loaded: nn.Module = AutoModelForImageTextToText.from_pretrained(
            config.model.path, dtype=dtype, attn_implementation=config.model.attn_implementation
        )
        return loaded
    tiny = config.model.tiny
    ids = {
        name: tokenizer.convert_tokens_to_ids(tok)
        for name, tok in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    # M-RoPE splits the rotary half-dimension over (time, height, width).
    half = tiny.hidden_size // tiny.num_heads // 2
    section = [half // 4, half // 4, half - 2 * (half // 4)]
    hf_config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": tiny.hidden_size,
            "intermediate_size": tiny.intermediate_size or 3 * tiny.hidden_size,
            "num_hidden_layers": tiny.num_layers,
            "num_attention_heads": tiny.num_heads,
            "num_key_value_heads": tiny.num_kv_heads,
            "max_position_embeddings": max(64, 2 * config.data.max_length),
            "rope_scaling": {"type": "mrope", "mrope_section": section},
            "tie_word_embeddings": True,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": None,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": tiny.hidden_size,
            "fullatt_block_indexes": [0],
            "window_size": 56,
            "in_channels": 3,
        },
        tie_word_embeddings=True,
        **ids,
    )
    hf_config._attn_implementation = config.model.attn_implementation
    model: nn.Module = Qwen2_5_VLForConditionalGeneration(hf_config)
    return model.to(dtype=dtype)


def apply_lora(model: nn.Module, config: SFTConfig) -> nn.Module:
    """Wrap the model with peft LoRA adapters (base weights frozen); identity when disabled."""
    if not config.lora.enabled:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError(
            "lora.enabled=true needs peft: install the extra `train-recipes[lora]`"
        ) from err
    lora = config.lora
    peft_config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), lora_dropout=0.0
    )
    wrapped: nn.Module = get_peft_model(model, peft_config)
    return wrapped


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _full(logits: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 works in place, so it is returned as is)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


@torch.no_grad()
def greedy_answers(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[list[dict[str, Any]]],
    *,
    max_new_tokens: int,
    device: torch.device,
    batch_size: int = 64,
    num_batches: int | None = None,
    images: Sequence[list[Any]] | None = None,
    image_processor: Any = None,
) -> list[str]:
    """Greedy-decode an answer for each chat prompt (messages without the final answer).

    Decoding recomputes the whole right-padded sequence at every step: no attention mask and
    no KV cache are needed (causal attention never sees the padding to the right), which keeps
    it exact for any batch composition. Every rank runs exactly ``num_batches`` batches of
    ``max_new_tokens`` forwards (padding the list with copies), so sharded models (FSDP2), whose
    forward is collective, stay in lock-step.

    With ``images`` (one list of PIL images per prompt) and a Qwen2-VL ``image_processor``, each
    ``<|image_pad|>`` placeholder is expanded to its image's token count and the pixels are
    passed with every forward, with the same [4, B, S] M-RoPE position ids as in training.

    Returns:
        The decoded answer text of each prompt (up to the end-of-turn token).
    """
    was_training = model.training
    model.eval()
    end_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id
    encoded = [
        list(
            tokenizer.apply_chat_template(
                p, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for p in prompts
    ]
    pixels: list[dict[str, torch.Tensor] | None] = [None] * len(encoded)
    if images is not None:
        image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        merge = int(image_processor.merge_size) ** 2
        for i, imgs in enumerate(images):
            if not imgs:
                continue
            feats = image_processor(images=list(imgs), return_tensors="pt")
            counts = iter([int(g.prod()) // merge for g in feats["image_grid_thw"]])
            expanded: list[int] = []
            for tok in encoded[i]:
                expanded.extend([image_pad] * next(counts) if tok == image_pad else [tok])
            encoded[i] = expanded
            pixels[i] = {
                "pixel_values": torch.as_tensor(feats["pixel_values"]),
                "image_grid_thw": torch.as_tensor(feats["image_grid_thw"]),
            }
    needed = (len(encoded) + batch_size - 1) // batch_size
    total_batches = needed if num_batches is None else num_batches
    answers: list[str] = []
    for b in range(total_batches):
        real = b * batch_size < len(encoded)
        lo = b * batch_size if real else 0
        chunk = encoded[lo : lo + batch_size] or [[pad_id]]
        parts = [p for p in pixels[lo : lo + batch_size] if p is not None]
        extra = {k: torch.cat([p[k] for p in parts]).to(device) for k in parts[0]} if parts else {}
        lengths = torch.tensor([len(x) for x in chunk])
        width = int(lengths.max()) + max_new_tokens
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for i, x in enumerate(chunk):
            ids[i, : len(x)] = torch.tensor(x)
        positions = None
        if images is not None:
            from train_recipes import _integrations as data_api

            positions = data_api.mrope_positions_for_prompts(
                ids,
                ids == image_pad,
                extra["image_grid_thw"] if extra else torch.zeros((0, 3), dtype=torch.long),
                spatial_merge_size=int(image_processor.merge_size),
            ).to(device)
        ids = ids.to(device)
        cur = lengths.clone().to(device)
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        rows = torch.arange(len(chunk), device=device)
        for _ in range(max_new_tokens):
            width_now = int(cur.max())
            if positions is not None:
                extra["position_ids"] = positions[..., :width_now]
            logits = _full(model(input_ids=ids[:, :width_now], use_cache=False, **extra).logits)
            nxt = logits[rows, cur - 1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            ids[rows, cur] = nxt
            done |= nxt == end_id
            cur = cur + 1
        if real:
            for i in range(len(chunk)):
                gen = ids[i, int(lengths[i]) :].tolist()
                if end_id in gen:
                    gen = gen[: gen.index(end_id)]
                answers.append(tokenizer.decode(gen, skip_special_tokens=True))
    model.train(was_training)
    return answers


def exact_match_accuracy(
    model: nn.Module,
    processor: Any,
    rows: Sequence[dict[str, Any]],
    *,
    max_new_tokens: int,
    device: torch.device,
    batch_size: int = 64,
    media_root: str | Path | None = None,
    tp: int = 1,
) -> float:
    """Held-out exact-match accuracy by greedy decoding, split over all ranks (collective).

    Args:
        processor: the tokenizer, or a processor with ``.tokenizer`` and ``.image_processor``.
        rows: chats whose last message is the reference assistant answer; ``media`` paths are
            relative to ``media_root``.
        tp: tensor-parallel degree; each tp group decodes the same rows together.

    Returns:
        The fraction of rows whose decoded answer equals the reference (stripped), same on
        every rank.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    # Ranks of one tensor-parallel group (tp innermost in the mesh) decode the same rows.
    replica, replicas = rank // tp, world // tp
    mine = list(rows)[replica::replicas]
    per_rank = (len(rows) + replicas - 1) // replicas
    num_batches = max(1, (per_rank + batch_size - 1) // batch_size)
    images = None
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is not None:
        from PIL import Image

        root = Path(media_root) if media_root is not None else Path(".")
        images = [[Image.open(root / m).convert("RGB") for m in r.get("media", [])] for r in mine]
    answers = greedy_answers(
        model,
        tokenizer_of(processor),
        [r["messages"][:-1] for r in mine],
        max_new_tokens=max_new_tokens,
        device=device,
        batch_size=batch_size,
        num_batches=num_batches,
        images=images,
        image_processor=image_processor,
    )
    correct = sum(
        a.strip() == r["messages"][-1]["content"].strip()
        for a, r in zip(answers, mine, strict=False)
    )
    counts = torch.tensor([correct, len(mine)], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(counts)
    return float(counts[0] / counts[1].clamp(min=1))


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated state dict on CPU (collective for FSDP2; only rank 0 gets tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def export_hf(
    model: nn.Module,
    tokenizer: Any,
    out_dir: str | Path,
    *,
    is_main: bool,
    lora_export: str = "merged",
) -> Path | None:
    """Write the model in Hugging Face format (config + safetensors + tokenizer) on rank 0.

    Collective under a process group: the weights are streamed shard by shard, each
    safetensors file written by one rank (``streaming_export``), never gathered whole. A
    peft LoRA model is written either
    merged into a plain model ("merged", from a copy: the live model keeps its adapters) or as
    the adapter alone ("adapter": adapter_config.json + adapter_model.safetensors, loadable with
    ``peft.PeftModel.from_pretrained(base, dir)``). Returns the directory on rank 0.
    """
    inner_model = unwrap(model)
    if _is_peft(inner_model):
        from train_recipes.lora_export import export_lora

        return export_lora(
            inner_model, tokenizer, out_dir, is_main=is_main, lora_export=lora_export
        )
    from train_recipes.moe import is_convertible, to_hf_layout

    if is_convertible(inner_model):
        # Converted MoE: the experts go back to the HF layout, gathered over ep (collective).
        state = to_hf_layout(model, _full_state_dict(model))
        if not is_main:
            return None
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        hf_model: Any = inner_model
        hf_model.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)
        logger.info("exported the MoE model to %s", out)
        return out
    from train_recipes.streaming_export import export_streaming

    out = export_streaming(unwrap(model), out_dir)
    if not is_main:
        return None
    tokenizer.save_pretrained(out)
    logger.info("exported the model to %s", out)
    return out
