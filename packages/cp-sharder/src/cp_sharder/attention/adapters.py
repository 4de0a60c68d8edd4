"""The two attention call signatures a model uses, adapted to a backend kernel in one place.

transformers models call a registry function ``(module, query, key, value, attention_mask,
dropout, scaling, sliding_window, softcap, **kwargs) -> (out [B, S, H, D], None)``; plain
PyTorch models call ``F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
is_causal, scale, enable_gqa) -> [B, H, S, D]``. Every backend needs the same reading of those
arguments and refuses what its kernel cannot honour with the same errors; each backend only
supplies its kernel and its :class:`Limits`.

Dimension letters: B batch, H heads, Hkv key/value heads, S local sequence, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["AttentionArgs", "Kernel", "Limits", "hf_attention", "sdpa_attention"]


@dataclass(kw_only=True, slots=True, frozen=True)
class AttentionArgs:
    """One attention call's options, read from either signature and already checked.

    Attributes:
        causal: causal attention (per document where the backend knows documents).
        scale: softmax scale; None means 1/sqrt(D).
        window: sliding window (transformers' convention: key j visible when i - j < window).
        dropout: attention dropout probability.
    """

    causal: bool
    scale: float | None
    window: int | None
    dropout: float


#: A backend kernel: ``(query [B, H, S, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv], args)
#: -> [B, H, S, Dv]``, this rank's queries over all ranks' keys.
Kernel = Callable[[Tensor, Tensor, Tensor, AttentionArgs], Tensor]


@dataclass(kw_only=True, slots=True, frozen=True)
class Limits:
    """What a backend's kernel cannot honour (it raises instead of silently ignoring it).

    Logit softcapping and a mask materialised by the model are refused by every backend: masks
    come from ``shard()``'s global layout, never from the local shard.

    Attributes:
        name: the backend as errors name it ("the portable CP attention").
        mask_source: where the backend's mask comes from, for the materialised-mask error.
        sliding_window: the kernel supports sliding windows.
        bidirectional: the kernel supports non-causal attention.
        dropout: the kernel supports attention dropout.
        compile_disabled: exclude the adapter from ``torch.compile`` (a graph break around the
            kernel), for kernels closing over per-step plans that would recompile every step.
    """

    name: str
    mask_source: str
    sliding_window: bool = True
    bidirectional: bool = True
    dropout: bool = True
    compile_disabled: bool = False

    def check(self, *, causal: bool, window: int | None, dropout: float) -> None:
        """Refuse options the kernel cannot honour."""
        if window is not None and not self.sliding_window:
            raise ValueError(
                f"{self.name} cannot honour sliding_window={window}; the portable backend "
                "supports sliding windows"
            )
        if not causal and not self.bidirectional:
            raise ValueError(
                f"{self.name} supports plain causal attention only (no mask, is_causal=True); "
                "the portable backend supports bidirectional attention"
            )
        if dropout and not self.dropout:
            raise ValueError(
                f"{self.name} has no attention dropout (got {dropout}); set the model's "
                "attention_dropout to 0"
            )


def _compiled_as(limits: Limits, fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compiler.disable(fn) if limits.compile_disabled else fn


def hf_attention(kernel: Kernel, limits: Limits) -> Callable[..., tuple[Tensor, None]]:
    """A transformers attention function (the registry signature) running ``kernel``.

    Returns:
        ``fn(module, query, key, value, attention_mask, ...) -> ([B, S, H, Dv], None)``.
    """

    def attention(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        if softcap is not None:
            raise ValueError(
                f"{limits.name} does not support logit softcapping (softcap={softcap}); use a "
                "model without attention softcapping"
            )
        if attention_mask is not None:
            raise ValueError(
                f"{limits.name} got a materialised attention mask from the model; "
                f"{limits.mask_source}. Pass padding as attention_mask (or seq_lens) to "
                "shard(), not to the model"
            )
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        # A dropout reaching a module in eval mode is never applied: not a refusal.
        limits.check(
            causal=causal, window=sliding_window, dropout=dropout if module.training else 0.0
        )
        args = AttentionArgs(causal=causal, scale=scaling, window=sliding_window, dropout=dropout)
        out = kernel(query, key, value, args)
        return out.transpose(1, 2).contiguous(), None

    return _compiled_as(limits, attention)


def sdpa_attention(kernel: Kernel, limits: Limits) -> Callable[..., Tensor]:
    """A stand-in for ``F.scaled_dot_product_attention`` running ``kernel`` ([B, H, S, D])."""

    def attention(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if attn_mask is not None:
            raise ValueError(
                f"{limits.name} cannot honour an explicit attn_mask under the SDPA override "
                "(it is local to the shard); pass padding as attention_mask to shard() and call "
                "SDPA with is_causal only"
            )
        limits.check(causal=is_causal, window=None, dropout=dropout_p)
        args = AttentionArgs(causal=is_causal, scale=scale, window=None, dropout=dropout_p)
        return kernel(query, key, value, args)

    return _compiled_as(limits, attention)
