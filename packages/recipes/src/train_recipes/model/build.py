"""Models of the SFT recipe: build (config-only tiny or from a folder), LoRA, compile, unwrap."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from train_recipes.config.sft import SFTConfig
from train_recipes.data.energon_api import is_vlm
from train_recipes.model.quiet_loading import from_pretrained_quietly

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "apply_lora",
    "build_model",
    "compile_decoder_layers",
    "decoder_layers",
    "unwrap",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(config: SFTConfig, tokenizer: PreTrainedTokenizerBase) -> nn.Module:
    """Load ``model.path`` or build the random-init tiny Llama from ``model.tiny``.

    Call after seeding: the tiny model's weights come from the global RNG.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    dtype = _DTYPES[config.model.dtype]
    if is_vlm(config):
        return _build_vlm(config, tokenizer, dtype)
    if config.model.path is not None:
        return from_pretrained_quietly(  # no weights bar on every rank
            AutoModelForCausalLM.from_pretrained,
            config.model.path,
            dtype=dtype,
            attn_implementation=config.model.attn_implementation,
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


def compile_decoder_layers(
    model: nn.Module, *, backend: str = "inductor", memory_budget: float | None = None
) -> int:
    """Compile the forward of every decoder layer in place; call before FSDP2 wrapping.

    The layer's ``forward`` is compiled, not the module: parameter names stay unchanged (no
    ``_orig_mod.``), so checkpoints and the HF export are unaffected, and module hooks (FSDP2's
    all-gather and reduce-scatter) run outside the compiled region. Identical layers share one
    graph.

    Args:
        model: a transformers model (plain, not yet wrapped).
        backend: the torch.compile backend ("aot_eager" makes tests fast on the CPU).
        memory_budget: the partitioner's activation memory budget for these layers only
            (``torch._functorch.config.activation_memory_budget`` while they compile): 1.0 saves
            what runs fastest, 0.0 what full recomputation would, values between trade
            recomputation in backward for fewer saved activations. None keeps torch's setting.
            It needs a backend that partitions with the min-cut partitioner ("inductor",
            "aot_eager_decomp_partition"); "aot_eager" ignores it.

    Returns:
        The number of layers compiled.
    """
    layers = decoder_layers(model)
    compiler: str | _BudgetedBackend = (
        backend if memory_budget is None else _BudgetedBackend(backend, memory_budget)
    )
    for layer in layers:
        # One backend object for all layers: dynamo reuses a graph only for the backend that
        # compiled it.
        layer.forward = torch.compile(layer.forward, backend=compiler)
    return len(layers)


class _BudgetedBackend:
    """A torch.compile backend that compiles with ``backend`` under an activation memory budget.

    The joint graph is split into forward and backward (the choice of what to save) while the
    backend compiles the forward, so the setting is patched around that call only: nothing
    outside these graphs sees it. AOTAutograd's cache key includes the functorch config, so a
    cached graph of another budget is not reused.
    """

    def __init__(self, backend: str, memory_budget: float) -> None:
        from torch._dynamo import lookup_backend

        self._compile = lookup_backend(backend)
        self.memory_budget = memory_budget

    def __call__(
        self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
    ) -> Callable[..., object]:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.memory_budget):
            return self._compile(graph, example_inputs)


def _build_vlm(
    config: SFTConfig, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype
) -> nn.Module:
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2_5_VLConfig,
    )

    if config.model.path is not None:
        loaded: nn.Module = from_pretrained_quietly(
            AutoModelForImageTextToText.from_pretrained,
            config.model.path,
            dtype=dtype,
            attn_implementation=config.model.attn_implementation,
        )
        return loaded
    tiny = config.model.tiny
    ids: dict[str, Any] = {  # Qwen2_5_VLConfig's token-id keywords
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
    # from_config builds the parameters in ``dtype`` and keeps the rotary tables in fp32, as
    # from_pretrained does (``.to(dtype)`` would round them: radians off at long positions).
    model: nn.Module = AutoModelForImageTextToText.from_config(hf_config, dtype=dtype)
    return model


def apply_lora(model: nn.Module, config: SFTConfig) -> nn.Module:
    """Wrap the model with peft LoRA adapters (base weights frozen); identity when disabled."""
    if not config.lora.enabled:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        from train_recipes.config.extras import install_hint

        raise ImportError(f"lora.enabled=true needs peft: {install_hint('lora')}") from err
    lora = config.lora
    peft_config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), lora_dropout=0.0
    )
    wrapped: nn.Module = get_peft_model(model, peft_config)
    return wrapped


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 works in place, so it is returned as is)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model
