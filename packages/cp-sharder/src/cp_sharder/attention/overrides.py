"""Scoped routing of a model's attention to a cp-sharder kernel (entered by ``train_ctx``).

- transformers models: register a function in transformers' attention registry and point the
  model's (text) configs at it; vision/audio towers keep their own attention.
- plain PyTorch models: replace ``torch.nn.functional.scaled_dot_product_attention``.

Both are undone on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["hf_attention_override", "sdpa_replaced"]


def _text_configs(model: torch.nn.Module) -> list[Any]:
    """The model's config and its sub-configs whose attention runs on the sharded sequence.

    Vision/audio sub-configs are left alone: those towers see whole images or clips, never a
    sequence shard, so their attention must stay local.
    """
    inner = getattr(model, "module", None)
    root = getattr(inner if isinstance(inner, torch.nn.Module) else model, "config", None)
    if root is None or not hasattr(root, "_attn_implementation_internal"):
        return []
    configs: dict[int, Any] = {}
    stack = [root]
    while stack:
        cfg = stack.pop()
        if id(cfg) in configs:
            continue
        configs[id(cfg)] = cfg
        for sub_key in getattr(cfg, "sub_configs", {}) or {}:
            if any(word in sub_key for word in ("vision", "audio", "image", "video", "speech")):
                continue
            sub = getattr(cfg, sub_key, None)
            if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                stack.append(sub)
    return list(configs.values())


@contextlib.contextmanager
def hf_attention_override(
    model: torch.nn.Module, key: str, fn: Callable[..., Any]
) -> Iterator[None]:
    """Route an unmodified transformers model's attention through ``fn`` inside the block.

    Registers ``fn`` under ``key`` in transformers' attention registry and points the model's
    (text) configs at it; on exit both are restored. A key unknown to transformers' mask registry
    also makes the model skip building its own (local, hence wrong) causal mask.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    configs = _text_configs(model)
    if not configs:
        raise ValueError(
            f"{type(model).__name__} has no transformers config with an attention implementation; "
            "the portable backend cannot route its attention"
        )
    saved = [(cfg, cfg._attn_implementation_internal) for cfg in configs]
    had_key = key in ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get(key)
    ALL_ATTENTION_FUNCTIONS[key] = fn
    try:
        for cfg in configs:
            cfg._attn_implementation_internal = key
        yield
    finally:
        for cfg, value in saved:
            cfg._attn_implementation_internal = value
        if had_key:
            ALL_ATTENTION_FUNCTIONS[key] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS[key]


@contextlib.contextmanager
def sdpa_replaced(fn: Callable[..., Any]) -> Iterator[None]:
    """Replace ``torch.nn.functional.scaled_dot_product_attention`` by ``fn`` inside the block.

    For plain PyTorch models that call SDPA with ``[B, H, S, D]`` tensors. The original function
    is restored on exit.
    """
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fn
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
