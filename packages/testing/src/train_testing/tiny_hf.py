"""Tiny, random-init, unmodified Hugging Face models built from a config (no downloads).

Every package's tests build the same few families at CPU size; their sizes live here once, and
a test overrides only the fields its check depends on (an odd vocabulary for uneven TP shards,
the demo tokenizer's size, a sliding window). transformers is imported inside the functions:
each package's ``test`` group names it, and importing this module costs nothing without it.

Families: ``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``mixtral``, ``deepseek_v3`` (causal
LMs, through ``AutoModelForCausalLM``), ``qwen2_5_vl`` (a vision-language model: one vision
block, M-RoPE) and ``bert`` (an encoder, ``BertModel``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

__all__ = [
    "CHATML_SPECIAL_TOKENS",
    "FAMILIES",
    "TEXT_SIZES",
    "VISION_SIZES",
    "parameters_to",
    "save_tiny",
    "tiny_config",
    "tiny_model",
    "tiny_tokenizer",
]

# Qwen2-VL's ChatML and image-placeholder tokens: pad first, then the rest (eos among them).
CHATML_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
)

# The sizes most tests use: 2 layers, hidden 32, grouped-query attention 4/2, vocabulary 128.
TEXT_SIZES: Mapping[str, int] = MappingProxyType(
    {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
)

# Fields each family adds to TEXT_SIZES (MoE: 4 experts top-2; DeepSeek-V3: 8 routed experts in 4
# groups of which 2 are kept, 1 shared expert, MLA heads, MoE from layer 1 on).
_FAMILY_FIELDS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "llama": {},
        "qwen2": {},
        "qwen3": {"head_dim": 8},
        "qwen3_moe": {
            "head_dim": 8,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
        "mixtral": {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
        "deepseek_v3": {
            "num_key_value_heads": 4,
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "q_lora_rank": None,
            "kv_lora_rank": 8,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 4,
        },
    }
)

# Qwen2.5-VL's vision tower: one block, 14-pixel patches merged 2x2, so a 56x56 image gives
# 4x4 patches and 4 placeholder tokens; its output width is the text hidden size.
VISION_SIZES: Mapping[str, Any] = MappingProxyType(
    {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [0],
    }
)

FAMILIES: tuple[str, ...] = (*_FAMILY_FIELDS, "qwen2_5_vl", "bert")


def tiny_config(
    family: str,
    *,
    attn_implementation: str | None = "sdpa",
    vision: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Any:
    """A tiny ``transformers`` config of ``family``: TEXT_SIZES, the family's fields, overrides.

    Args:
        family: one of :data:`FAMILIES`.
        attn_implementation: set on the config (None keeps transformers' default choice).
        vision: ``qwen2_5_vl`` only: fields replacing :data:`VISION_SIZES`.
        **overrides: config fields. For ``qwen2_5_vl`` the top-level token ids
            (``image_token_id``, ``video_token_id``, ``vision_start_token_id``,
            ``vision_end_token_id``) go to the outer config, everything else to ``text_config``.

    Returns:
        The config (a ``transformers.PretrainedConfig``).

    Raises:
        ValueError: ``family`` is not one of :data:`FAMILIES`, or ``vision`` is given for a
            text-only family.
    """
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {FAMILIES}")
    if vision is not None and family != "qwen2_5_vl":
        raise ValueError(f"vision= is for 'qwen2_5_vl' only, not {family!r}; drop it")
    attn = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if family == "qwen2_5_vl":
        return _qwen2_5_vl_config(attn, dict(vision or {}), overrides)
    if family == "bert":
        # BERT has no key/value heads and names its length limit the same way.
        fields = {k: v for k, v in TEXT_SIZES.items() if k != "num_key_value_heads"}
        return AutoConfig.for_model("bert", **{**fields, **overrides}, **attn)
    fields = {**TEXT_SIZES, **_FAMILY_FIELDS[family], **overrides}
    return AutoConfig.for_model(family, **fields, **attn)


_VL_OUTER_FIELDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "tie_word_embeddings",
)


def _qwen2_5_vl_config(
    attn: dict[str, Any], vision: dict[str, Any], overrides: dict[str, Any]
) -> Any:
    from transformers import Qwen2_5_VLConfig

    outer = {k: overrides.pop(k) for k in _VL_OUTER_FIELDS if k in overrides}
    # No BOS/EOS: Qwen's defaults lie outside a tiny vocabulary.
    text: dict[str, Any] = {
        **TEXT_SIZES,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        **overrides,
    }
    # M-RoPE splits the rotary half of each head over (time, height, width).
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    text.setdefault(
        "rope_parameters",
        {"rope_type": "default", "mrope_section": [half // 4, half // 4, half - 2 * (half // 4)]},
    )
    vision_fields = {**VISION_SIZES, "out_hidden_size": text["hidden_size"], **vision}
    outer.setdefault("tie_word_embeddings", text["tie_word_embeddings"])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision_fields, **outer, **attn)


def tiny_model(
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init_std: float | None = None,
    **config_fields: Any,
) -> nn.Module:
    """A seeded random-init model of :func:`tiny_config` ``(family, **config_fields)``.

    Args:
        family: one of :data:`FAMILIES`.
        seed: ``torch.manual_seed`` before construction (same seed, same weights).
        dtype: the parameters' dtype (float64 for references).
        init_std: redraw every parameter from N(0, init_std) (a larger spread than HF's init
            makes routers and small differences visible); None keeps HF's initialisation.
        **config_fields: passed to :func:`tiny_config` (``attn_implementation``, ``vision``,
            fields).

    Returns:
        The model, in train mode as transformers builds it (call ``.eval()`` where dropout matters).
    """
    import transformers

    config = tiny_config(family, **config_fields)
    torch.manual_seed(seed)
    model: nn.Module
    if family == "qwen2_5_vl":
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    elif family == "bert":
        model = transformers.BertModel(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, init_std)
    return parameters_to(model, dtype)


def parameters_to(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``model``'s parameters to ``dtype``, leaving its buffers as they are.

    ``model.to(torch.bfloat16)`` would round the rotary ``inv_freq`` tables too, which
    ``from_pretrained(dtype=torch.bfloat16)`` keeps in fp32: at position 4096 the rounded
    frequencies are off by radians. Casting the parameters alone gives the model
    ``from_pretrained`` would.

    Returns:
        ``model`` itself.
    """
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items()]
    model.to(dtype)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    return model


def save_tiny(model: nn.Module, directory: Path, *, tokenizer: Any = None) -> Path:
    """``save_pretrained`` the model (and the tokenizer, if given) into ``directory``."""
    model.save_pretrained(directory)  # type: ignore[operator]
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def tiny_tokenizer(
    corpus: list[str],
    *,
    vocab_size: int,
    chat_template: str,
    special_tokens: Sequence[str] = CHATML_SPECIAL_TOKENS,
) -> Any:
    """A byte-level BPE trained on ``corpus``, wrapped as a fast tokenizer with a chat template.

    Args:
        corpus: the training texts (a few sentences are enough).
        vocab_size: the BPE vocabulary size, special tokens included.
        chat_template: the Jinja chat template.
        special_tokens: the first is the pad token, the others are additional special tokens;
            ``<|im_end|>`` must be among them (it is the end-of-sequence token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token=special_tokens[0],
        additional_special_tokens=list(special_tokens[1:]),
    )
    fast.chat_template = chat_template
    return fast
