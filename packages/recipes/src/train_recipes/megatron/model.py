"""Build a megatron-core ``GPTModel`` for a Llama-style Hugging Face config.

The model uses megatron-core's local layer spec (no Transformer Engine) with
:class:`SegmentCausalAttention` as its core attention, RMSNorm, SwiGLU and RoPE, so it runs
wherever PyTorch does. megatron-core 0.16.1 is the version supported here: the last release
that installs on Python 3.11, which this project's CI uses (0.17 and later need Python 3.12).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from train_recipes.config.extras import install_hint

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig
    from transformers import PretrainedConfig

__all__ = [
    "MEGATRON_EXTRA",
    "build_gpt_model",
    "init_megatron_parallel",
    "padded_vocab_size",
    "require_megatron",
    "rope_base",
    "transformer_config",
]

#: The extra that installs megatron-core for this backend (named in every error about it).
MEGATRON_EXTRA = "megatron"

# Llama-style model types whose layers this backend maps one to one (see convert.py).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def require_megatron() -> ModuleType:
    """The ``megatron.core`` module, or an ImportError naming the extra."""
    try:
        return importlib.import_module("megatron.core")
    except ImportError as err:
        raise ImportError(
            f"model.backend=megatron needs megatron-core; {install_hint(MEGATRON_EXTRA)} "
            "(megatron-core 0.16.1 on Python 3.11)"
        ) from err


def init_megatron_parallel(tp: int, *, seed: int) -> None:
    """Create megatron-core's process groups (tp innermost, the recipe's mesh order) and seed.

    megatron-core keeps its groups in module state (``parallel_state``); a second call with
    the same ``tp`` keeps them, another ``tp`` raises.

    Args:
        tp: tensor-parallel size (divides the world size; the rest is data parallelism).
        seed: the run's seed, for megatron-core's model-parallel RNG tracker.
    """
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have != tp:
            raise RuntimeError(
                f"megatron-core's process groups exist with tp={have}, not tp={tp}; call "
                "megatron.core.parallel_state.destroy_model_parallel() first"
            )
        return
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"parallel.tp={tp} does not divide the world size {world}")
    # "tp-cp-ep-dp-pp": consecutive ranks form a tp group, as in the recipe's (dp, cp, tp) mesh.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    # Seeds the per-TP-rank RNG states Megatron's dropout and init forks read (CUDA RNG).
    mp_random.model_parallel_cuda_manual_seed(seed)


def rope_base(hf_config: PretrainedConfig) -> float:
    """RoPE's base (theta) of an HF config; only unscaled ("default") RoPE is mapped.

    transformers 5 keeps it in ``rope_parameters`` (also read as ``rope_scaling``), 4.x in
    ``rope_theta`` with ``rope_scaling`` None for plain RoPE.

    Raises:
        ValueError: any other ``rope_type`` (llama3, yarn, linear, ...).
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"rope_type={rope_type!r} ({params}) is not mapped to megatron-core by this backend; "
            "use model.backend=hf, or a config with plain RoPE"
        )
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def transformer_config(
    hf_config: PretrainedConfig, *, tp: int, dtype: torch.dtype
) -> TransformerConfig:
    """megatron-core's ``TransformerConfig`` equal to a Llama-style HF config.

    Raises:
        ValueError: a model type, RoPE scaling or bias this backend does not map, or head
            counts that tp does not divide.
    """
    require_megatron()
    from megatron.core.transformer import TransformerConfig

    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model.backend=megatron builds Llama-style models ({', '.join(SUPPORTED_MODEL_TYPES)}), "
            f"not model_type={model_type!r}; use model.backend=hf for it"
        )
    rope_base(hf_config)  # raises for a RoPE scaling this backend does not map
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError(
            "attention_bias/mlp_bias models are not mapped by the megatron backend (Llama has "
            "no biases); use model.backend=hf"
        )
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if heads % tp or groups % tp:
        raise ValueError(
            f"parallel.tp={tp} must divide num_attention_heads={heads} and "
            f"num_key_value_heads={groups}; pick a tp that divides both"
        )
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The fusions need Apex/TE kernels; the local spec runs the plain PyTorch ops.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        tensor_model_parallel_size=tp,
        sequence_parallel=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Weights are built on the CPU (and loaded from HF right after), then moved.
        use_cpu_initialization=True,
        # The weights are overwritten from the HF model right after (convert.load_hf_weights),
        # but megatron-core marks its tp-sharded weights (``tensor_model_parallel``, which the
        # Engine's tp-aware clipping reads) only while initialising them.
        perform_initialization=True,
    )


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (Megatron splits it evenly over tp).

    The padding rows of the embedding and output layer are zeros; their logits are masked to
    -inf before any softmax (``training.mask_padded_vocab``), so they change no probability.
    """
    return -(-vocab_size // tp) * tp


def build_gpt_model(hf_config: PretrainedConfig, *, tp: int, dtype: torch.dtype) -> nn.Module:
    """A megatron-core ``GPTModel`` with the architecture of ``hf_config``, on the CPU.

    Its output stays vocab-parallel (``parallel_output=True``: logits [B, S, V / tp] as plain
    local shards over Megatron's tensor-parallel group), which vocab-parallel's
    ``vocab_group=`` form reads without gathering. Call :func:`init_megatron_parallel` first.

    The vocabulary is padded to a multiple of tp (:func:`padded_vocab_size`).
    """
    require_megatron()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from train_recipes.megatron.attention import SegmentCausalAttention

    config = transformer_config(hf_config, tp=tp, dtype=dtype)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SegmentCausalAttention
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp),
        max_sequence_length=hf_config.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_base(hf_config),  # typed int by Megatron, used as a float
    )
    # The real vocabulary, for masking the padding's logits (training.mask_padded_vocab).
    model.unpadded_vocab_size = hf_config.vocab_size
    return model
