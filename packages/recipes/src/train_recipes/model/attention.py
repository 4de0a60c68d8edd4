"""Attention selection of the SFT recipe: SDPA backends and the mask-free causal fast path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from train_recipes.model.build import unwrap

__all__ = [
    "CAUSAL_ATTENTION",
    "CausalFastPath",
    "attention_path",
    "rows_are_packed",
    "sdpa_backends",
]


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
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,  # transformers' attention keywords (dropout, scaling, ...), passed on
) -> tuple[torch.Tensor, None]:
    """Transformers' SDPA attention, called without a mask: plain causal attention."""
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
        vlm: the image-text path (a Qwen2.5-VL-style vision tower runs
            ``train_recipes.model.vision_attention``'s varlen attention, not covered here).
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
    forward. The recipe knows from the host copy of the batch whether rows are packed: inside
    :meth:`selected` with ``packed=False`` the model runs a registered attention that
    transformers gives no mask (its SDPA attention, called causal and unmasked: the same
    computation); with ``packed=True`` (rows needing the per-document mask) it keeps
    transformers' SDPA. The choice lasts for the ``with`` block only: transformers looks the
    attention function up in the model's config on every call, so the block sets the config's
    implementation on entry and restores it on exit, and no later forward (generation, padded
    evaluation, the HF export) inherits it.

    Args:
        model: a text transformers model whose attention implementation is "sdpa" (otherwise
            :meth:`selected` changes nothing).
    """

    def __init__(self, model: nn.Module) -> None:
        from transformers import AttentionInterface

        self._model = unwrap(model)
        self._base = getattr(self._model.config, "_attn_implementation", None)
        self.enabled = self._base == "sdpa"
        if self.enabled:
            # transformers' registry is global; registering the same function under the same
            # name again is harmless, and nothing uses the name unless a config selects it.
            AttentionInterface.register(CAUSAL_ATTENTION, _causal_sdpa)

    @contextlib.contextmanager
    def selected(self, *, packed: bool) -> Iterator[None]:
        """Select the attention for the ``with`` block's forwards.

        The mask-free causal attention for unpacked rows (``packed=False``), transformers' SDPA
        for packed ones. Wrap the forward; the backward needs no wrapping.
        """
        if not self.enabled or packed:
            yield
            return
        config: Any = self._model.config
        previous = config._attn_implementation
        # The config setter (what from_config's attn_implementation sets): the model's layers
        # share this config.
        config._attn_implementation = CAUSAL_ATTENTION
        try:
            yield
        finally:
            config._attn_implementation = previous
