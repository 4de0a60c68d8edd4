"""torch's native ring attention (``torch.distributed.tensor.experimental.context_parallel``).

CUDA only and causal only: torch dispatches flash, memory-efficient and cuDNN SDPA to its ring
kernels and rejects masks. The sharder uses it for plain causal SDPA on CUDA with the head/tail
layout, which is the order torch's load balancer assumes. Imported lazily.

Dimension letters: B batch, H heads, S local sequence, D head dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cp_sharder._dist import CPGroup

#: Name under which the attention function is registered in transformers' attention registry.
HF_ATTENTION_KEY = "cp_sharder_torch_ring"


def hf_ring_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function that hands causal SDPA to torch's CP dispatcher.

    Args:
        query: [B, H, S, D] local queries (head/tail layout).
        key, value: [B, Hkv, S, D].

    Returns:
        ([B, S, H, D], None).
    """
    if sliding_window is not None:
        raise ValueError(
            f"torch's ring attention is causal-only and cannot honour sliding_window={sliding_window}; "
            "the portable backend supports sliding windows"
        )
    if attention_mask is not None or not getattr(module, "is_causal", True):
        raise ValueError(
            "torch's ring attention supports plain causal attention only (no mask, is_causal=True)"
        )
    if key.shape[1] != query.shape[1]:
        # torch's ring kernels need equal head counts and its CP dispatcher does not honour
        # enable_gqa (on an H200 with torch 2.11: no kernel in fp32, wrong K/V gradients in
        # bf16), so the KV heads are expanded here; autograd sums their gradients back.
        repeats = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)
    out = F.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, is_causal=True, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def torch_ring_context(cp: CPGroup, padded_len: int) -> Iterator[None]:
    """Enable torch's CP SDPA dispatch on the CP mesh (the batch is already sharded).

    Args:
        cp: the CP group (its mesh must be a CUDA mesh).
        padded_len: P, the global padded length; torch derives its load balancer from it.

    Raises:
        RuntimeError: no CUDA CP mesh (torch's ring runs on CUDA only), or torch's load
            balancing switched off (its ring would then assume contiguous shards).
    """
    if cp.mesh is None or cp.mesh.device_type != "cuda":
        raise RuntimeError(
            "torch's native context_parallel runs on CUDA only; the cp mesh is on "
            f"{getattr(cp.mesh, 'device_type', None)!r}. The portable backend runs on CPU"
        )
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not getattr(_attention._cp_options, "enable_load_balance", True):
        raise RuntimeError(
            "torch's context-parallel load balancing is disabled, but the sharder lays tokens out "
            "head/tail; re-enable _cp_options.enable_load_balance"
        )
    backends = [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
    ]
    # The legacy API reshards at least one buffer and reads the global length (which picks the
    # head/tail balancer) from it; our tensors are already sharded, so it gets a throwaway one.
    probe = torch.empty(1, padded_len, device=f"cuda:{torch.cuda.current_device()}")
    with sdpa_kernel(backends), context_parallel(cp.mesh, buffers=[probe], buffer_seq_dims=[1]):
        yield


def make_context(
    model: torch.nn.Module, cp: CPGroup, hf: bool, padded_len: int
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """The train_ctx factory for this backend."""
    from cp_sharder.attention.portable import hf_attention_override

    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if hf:
                stack.enter_context(
                    hf_attention_override(model, HF_ATTENTION_KEY, hf_ring_attention)
                )
            stack.enter_context(torch_ring_context(cp, padded_len))
            yield

    return ctx
