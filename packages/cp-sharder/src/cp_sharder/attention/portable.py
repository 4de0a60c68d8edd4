"""Portable context-parallel attention: all-gather K/V, mask by global token index.

Plain PyTorch on torch.distributed, so it runs on CPU/gloo as well as CUDA/NCCL. Each rank
keeps its queries, all-gathers keys and values (one collective per layer; the backward
reduce-scatters dK/dV back to their owners), and builds the mask from the global position of
every query and key: causal, per-document (block-diagonal causal), sliding window, key padding.
The gathered keys stay in rank order; the mask, not a permutation, restores global semantics.

Dimension letters: B batch, H heads, Hkv key/value heads, Sq local queries, P padded global
length, D head dim.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from cp_sharder._dist import CPGroup, all_gather_seq
from cp_sharder.attention.adapters import (
    AttentionArgs,
    Kernel,
    Limits,
    hf_attention,
    sdpa_attention,
)
from cp_sharder.attention.overrides import hf_attention_override, sdpa_replaced

__all__ = [
    "HF_ATTENTION_KEY",
    "MaskSpec",
    "cp_attention",
    "hf_attention_override",
    "make_hf_attention",
    "sdpa_override",
]

logger = logging.getLogger(__name__)

# Captured at import so the SDPA override below can never route this module's own call back
# into itself.
_SDPA = F.scaled_dot_product_attention

#: Name under which the attention function is registered in transformers' attention registry.
HF_ATTENTION_KEY = "cp_sharder_portable"


@dataclass(kw_only=True, slots=True)
class MaskSpec:
    """Global token metadata of one step, from which every layer's mask is built.

    Attributes:
        q_index: [Sq] int64 global positions of this rank's tokens, in local order.
        k_index: [P] int64 global positions of the gathered keys (all ranks' q_index, rank order).
        doc_ids: [B or 1, P] int64 document id at each global position, or None (one document).
        key_valid: [B, P] bool, False for keys no query may attend to (padding), or None.
        cache: masks already built this step, keyed by (causal, window, device).
    """

    q_index: Tensor
    k_index: Tensor
    doc_ids: Tensor | None = None
    key_valid: Tensor | None = None
    cache: dict[tuple[bool, int | None, str], Tensor] = field(default_factory=dict)

    def mask(self, *, causal: bool, window: int | None, device: torch.device) -> Tensor:
        """[B or 1, 1, Sq, P] bool: True where query i may attend to key j."""
        key = (causal, window, str(device))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        qi = self.q_index.to(device)[:, None]
        ki = self.k_index.to(device)[None, :]
        allowed = torch.ones(qi.shape[0], ki.shape[1], dtype=torch.bool, device=device)[None]
        if causal:
            allowed = allowed & (ki <= qi)
        if window is not None:
            # transformers' convention: key j is visible to query i when i - j < window.
            allowed = allowed & (qi - ki < window)
        if self.doc_ids is not None:
            docs = self.doc_ids.to(device)
            allowed = allowed & (
                docs[:, self.q_index.to(device)][:, :, None]
                == docs[:, self.k_index.to(device)][:, None, :]
            )
        if self.key_valid is not None:
            allowed = allowed & self.key_valid.to(device)[:, self.k_index.to(device)][:, None, :]
        # A query that may see nothing (a padding query) attends to itself, so no row is all
        # -inf: its output is never used by a real token, but NaNs would poison the backward.
        empty = ~allowed.any(dim=-1, keepdim=True)
        allowed = allowed | (empty & (ki == qi))
        result = allowed[:, None]
        self.cache[key] = result
        return result


def cp_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    spec: MaskSpec,
    cp: CPGroup,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Attention of local queries over all ranks' keys and values.

    Args:
        query: [B, H, Sq, D] this rank's queries.
        key: [B, Hkv, Sq, D] this rank's keys (Hkv divides H).
        value: [B, Hkv, Sq, Dv] this rank's values.
        spec: the step's global token metadata.
        cp: the CP group.
        causal: mask keys after the query.
        window: sliding-window size (keys with i - j >= window are masked), or None.
        scale: softmax scale; None means 1/sqrt(D).
        dropout_p: attention dropout probability.

    Returns:
        [B, H, Sq, Dv].
    """
    if query.shape[2] != spec.q_index.numel():
        raise ValueError(
            f"attention got {query.shape[2]} local queries but the shard layout holds "
            f"{spec.q_index.numel()} tokens per rank; call the model inside the train_ctx of "
            "the shard() that produced this batch"
        )
    head_dim = key.shape[-1]
    # One collective for K and V together.
    kv = torch.cat([key, value], dim=-1)
    kv = all_gather_seq(kv, dim=2, cp=cp)
    full_key, full_value = kv[..., :head_dim], kv[..., head_dim:]
    if full_key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // full_key.shape[1]
        full_key = full_key.repeat_interleave(repeat, dim=1)
        full_value = full_value.repeat_interleave(repeat, dim=1)
    mask = spec.mask(causal=causal, window=window, device=query.device)
    return _SDPA(query, full_key, full_value, attn_mask=mask, dropout_p=dropout_p, scale=scale)


#: What the portable kernel cannot honour.
LIMITS = Limits(
    name="the portable CP attention",
    mask_source="it builds its own from global token indices",
)


def _kernel(spec: MaskSpec, cp: CPGroup) -> Kernel:
    def kernel(query: Tensor, key: Tensor, value: Tensor, args: AttentionArgs) -> Tensor:
        return cp_attention(
            query,
            key,
            value,
            spec=spec,
            cp=cp,
            causal=args.causal,
            window=args.window,
            scale=args.scale,
            dropout_p=args.dropout,
        )

    return kernel


def make_hf_attention(spec: MaskSpec, cp: CPGroup) -> Callable[..., tuple[Tensor, None]]:
    """A transformers attention function (the registry signature) bound to this step."""
    return hf_attention(_kernel(spec, cp), LIMITS)


@contextlib.contextmanager
def sdpa_override(spec: MaskSpec, cp: CPGroup) -> Iterator[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through CP attention.

    For plain PyTorch models that call SDPA with ``[B, H, S, D]`` tensors and ``is_causal`` (no
    ``attn_mask``). The original function is restored on exit.
    """
    with sdpa_replaced(sdpa_attention(_kernel(spec, cp), LIMITS)):
        yield
