"""The Llama-style SFT benchmark model: a 1.5B configuration, its tiny stand-in, and its FLOPs.

``train-engine``'s ``sft_llama.py``, ``train-recipes``' ``sft_step.py`` and the multi-GPU run's
``engine`` section all time one SFT step of this model, so their numbers compare.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# hidden 2048, 16 layers, 32 / 8 heads, FFN 8192, vocabulary 128256, untied head: 1.50B params.
LLAMA_1P5B: Mapping[str, int] = MappingProxyType(
    {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    }
)
# The same shape of model at CPU size (the `--quick` runs).
LLAMA_TINY: Mapping[str, int] = MappingProxyType(
    {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    }
)


def llama_dims(*, quick: bool) -> dict[str, int]:
    """A fresh copy of the tiny (``quick``) or the 1.5B ``LlamaConfig`` sizes."""
    return dict(LLAMA_TINY if quick else LLAMA_1P5B)


def llama_config(dims: Mapping[str, int], *, max_len: int) -> Any:
    """A ``transformers.LlamaConfig`` of ``dims`` for training: SDPA, untied head, no KV cache.

    Raises:
        ImportError: transformers is not installed (the message says how to install it).
    """
    try:
        from transformers import LlamaConfig
    except ImportError as err:
        raise ImportError("this benchmark needs `transformers` (pip install transformers)") from err
    fields: dict[str, Any] = {
        **dims,
        "max_position_embeddings": max_len,
        "tie_word_embeddings": False,
        "attn_implementation": "sdpa",
        "use_cache": False,
    }
    return LlamaConfig(**fields)


def flops_per_token(n_params: int, config: Any, seq: int) -> float:
    """Model FLOPs of one trained token: 6 x parameters + 6 x layers x hidden x S (attention).

    Args:
        n_params: the parameters counted (all, or all but the embedding: the caller's choice).
        config: a transformers config with ``num_hidden_layers`` and ``hidden_size``.
        seq: S, the sequence length (causal attention's cost grows with it).
    """
    return 6.0 * n_params + 6.0 * config.num_hidden_layers * config.hidden_size * seq


def add_sft_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every SFT-step benchmark shares: device, batch x sequence, steps, warm-up."""
    from train_testing.bench.runtime import add_device_argument

    add_device_argument(parser)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)


def resolve_sft_step_sizes(args: argparse.Namespace) -> None:
    """``--quick``: tiny batch and few steps (any device); full size: refuse anything but CUDA.

    Raises:
        SystemExit: full size asked for off CUDA (a one-line error naming ``--quick``).
    """
    if args.quick:
        args.batch, args.seq, args.steps, args.warmup = 2, 32, 2, 1
    elif args.device != "cuda":
        raise SystemExit("the full-size benchmark needs --device cuda; use --quick on the CPU")
