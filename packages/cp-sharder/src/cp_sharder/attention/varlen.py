"""Variable-length (per-document) attention on packed THD tensors: the one kernel entry point.

Every packed path of cp-sharder (cp=1 and context parallel, transformers and plain PyTorch
models) calls :func:`varlen_attention` with a :class:`Segments` table. Query segment ``i`` holds
tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and attends to key segment ``i``
(``cu_seqlens_k[i]:cu_seqlens_k[i+1]``) only. Causal masking is bottom-right aligned, as in
FlashAttention: the queries of a segment are the *last* ``Lq`` positions of its ``Lk`` keys, so a
query chunk taken from the middle of a document attends to the document's prefix up to itself,
which is what context parallelism needs.

Kernels:

- CUDA, float16/bfloat16: torch's ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention),
  when the installed torch has it. Its signature changed across releases (``is_causal`` in
  2.10, ``window_size`` from 2.11, ``enable_gqa`` later), so the call is built from the
  function's own signature.
- Elsewhere (CPU, float32/float64, or no ``varlen_attn``): one scaled-dot-product call per
  segment, with a small ``[Lq, Lk]`` boolean mask only where the segment is not square. Memory
  and time are ``O(sum of Lq * Lk)``, never ``O(T^2)``. FlexAttention is not used here: in eager
  mode it materialises the full ``[H, T, T]`` score matrix, and compiling it costs more than the
  whole step on CPU.

Dimension letters: T packed tokens, H query heads, Hkv key/value heads, D head dim, N segments.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Segments", "torch_varlen_available", "varlen_attention"]

# Captured at import so an SDPA override (plain models) can never route this call to itself.
_SDPA = F.scaled_dot_product_attention

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(kw_only=True, slots=True, frozen=True)
class Segments:
    """The segment table of one varlen call: which keys each query segment attends to.

    Attributes:
        cu_seqlens_q: [N+1] int cumulative query segment lengths, from 0 to T.
        cu_seqlens_k: [N+1] int cumulative key segment lengths, from 0 to Tk. The same tensor
            object as ``cu_seqlens_q`` when queries and keys coincide (lets torch pick cuDNN
            where it may).
        max_seqlen_q: the longest query segment.
        max_seqlen_k: the longest key segment.
    """

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@functools.cache
def _torch_varlen() -> tuple[Callable[..., Any], frozenset[str]] | None:
    """The ``varlen_attn`` of torch and the names of its parameters; None when torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def torch_varlen_available() -> bool:
    """Whether the installed torch provides ``torch.nn.attention.varlen.varlen_attn``."""
    return _torch_varlen() is not None


def _use_torch_varlen(query: Tensor, window: int | None) -> bool:
    found = _torch_varlen()
    if found is None or not query.is_cuda or query.dtype not in _FLASH_DTYPES:
        return False
    # FlashAttention's head-dim limits; other shapes take the per-segment path.
    if query.shape[-1] % 8 or query.shape[-1] > 256:
        return False
    _, params = found
    return window is None or "window_size" in params


def _check(query: Tensor, key: Tensor, value: Tensor, segments: Segments) -> None:
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            "varlen_attention takes THD tensors [T, H, D]; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if key.shape[1] != value.shape[1] or query.shape[1] % key.shape[1]:
        raise ValueError(
            f"query has {query.shape[1]} heads and key/value {key.shape[1]}/{value.shape[1]}; "
            "key and value need the same head count, dividing the query heads (GQA)"
        )
    cu_q, cu_k = segments.cu_seqlens_q, segments.cu_seqlens_k
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_q.numel()} entries and cu_seqlens_k {cu_k.numel()}; "
            "both need N+1 entries for the same N segments"
        )


def _torch_varlen_call(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    segments: Segments,
    *,
    causal: bool,
    scale: float | None,
    window: int | None,
) -> Tensor:
    found = _torch_varlen()
    assert found is not None
    fn, params = found
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        # transformers' window convention (key j visible when i - j < window) is flash's
        # left window of window - 1.
        left = window - 1 if window is not None else -1
        kwargs["window_size"] = (left, 0) if causal else (left, -1)
    else:
        kwargs["is_causal"] = causal
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        else:
            query = query * (scale * math.sqrt(query.shape[-1]))
    if key.shape[1] != query.shape[1] and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    # Older releases have no enable_gqa: FlashAttention's varlen kernel takes fewer KV heads
    # natively (num_heads % num_heads_k == 0).
    cu_q, cu_k = segments.cu_seqlens_q, segments.cu_seqlens_k
    cu_q32 = cu_q.to(device=query.device, dtype=torch.int32)
    cu_k32 = cu_q32 if cu_k is cu_q else cu_k.to(device=query.device, dtype=torch.int32)
    max_q, max_k = segments.max_seqlen_q, segments.max_seqlen_k
    out = fn(query, key, value, cu_q32, cu_k32, max_q, max_k, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _segment_mask(
    q_len: int, k_len: int, *, causal: bool, window: int | None, device: torch.device
) -> Tensor | None:
    """[Lq, Lk] bool, bottom-right aligned, or None when SDPA's own flags express it."""
    if not causal and window is None:
        return None
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (q_pos - k_pos < window)
    return allowed


def _per_segment(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_q: list[int],
    cu_k: list[int],
    *,
    causal: bool,
    scale: float | None,
    window: int | None,
) -> Tensor:
    gqa = key.shape[1] != query.shape[1]
    outs: list[Tensor] = []
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        if k1 - k0 < q1 - q0 and causal:
            raise ValueError(
                f"segment {i} has {q1 - q0} queries but {k1 - k0} keys; causal segments need at "
                "least as many keys as queries (the queries are the last keys)"
            )
        q = query[q0:q1].transpose(0, 1)  # [H, Lq, D]
        k = key[k0:k1].transpose(0, 1)
        v = value[k0:k1].transpose(0, 1)
        square = q1 - q0 == k1 - k0 and window is None
        if square:
            out = _SDPA(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        else:
            mask = _segment_mask(
                q1 - q0, k1 - k0, causal=causal, window=window, device=query.device
            )
            out = _SDPA(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(0, 1))
    if not outs:
        return query.new_zeros(0, query.shape[1], value.shape[-1])
    result = torch.cat(outs, dim=0)
    if result.shape[0] != query.shape[0]:
        raise ValueError(
            f"cu_seqlens_q covers {result.shape[0]} tokens but the query holds {query.shape[0]}"
        )
    return result


def varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    segments: Segments,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """Attention of each query segment over its own key segment (differentiable).

    Args:
        query: [T, H, D] packed queries.
        key: [Tk, Hkv, D] packed keys (Hkv divides H).
        value: [Tk, Hkv, Dv] packed values.
        segments: the query and key segments (their ``cu_seqlens`` run from 0 to T and Tk).
        causal: mask keys after each query, bottom-right aligned (a segment's queries are the
            last ``Lq`` of its ``Lk`` keys).
        scale: softmax scale; None means 1/sqrt(D).
        window: sliding window in transformers' convention (key j visible to query i when
            ``i - j < window``), or None.

    Returns:
        [T, H, Dv].

    Raises:
        ValueError: tensors not [T, H, D], head counts that do not divide, or segment tables of
            different lengths.
    """
    _check(query, key, value, segments)
    if _use_torch_varlen(query, window):
        return _torch_varlen_call(
            query, key, value, segments, causal=causal, scale=scale, window=window
        )
    shared = segments.cu_seqlens_k is segments.cu_seqlens_q
    cu_q = segments.cu_seqlens_q.tolist()
    cu_k = cu_q if shared else segments.cu_seqlens_k.tolist()
    return _per_segment(query, key, value, cu_q, cu_k, causal=causal, scale=scale, window=window)
