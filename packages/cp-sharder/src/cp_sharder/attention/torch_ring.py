"""torch's native ring attention (``torch.distributed.tensor.experimental.context_parallel``).

CUDA only and causal only: torch dispatches flash, memory-efficient and cuDNN SDPA to its ring
kernels and rejects masks. The sharder uses it for plain causal SDPA on CUDA with the head/tail
layout, which is the order torch's load balancer assumes. Imported lazily.

Dimension letters: B batch, H heads, S local sequence, D head dim.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cp_sharder._dist import CPGroup
from cp_sharder.attention.adapters import AttentionArgs, Limits, hf_attention

#: Name under which the attention function is registered in transformers' attention registry.
HF_ATTENTION_KEY = "cp_sharder_torch_ring"


class _RingSDPA(torch.autograd.Function):
    """Causal SDPA whose backward also runs under torch's ring dispatch.

    torch routes SDPA to its ring kernels only while its context is active. ``train_ctx`` wraps
    the forward alone, so a plain call would run its backward outside the context and compute
    local-only attention gradients (measured on an H200: right loss, gradient error 1.6). This
    function records the forward on detached inputs and re-enters the context for backward.
    """

    @staticmethod
    def forward(
        ctx: Any,
        reenter: Callable[[], contextlib.AbstractContextManager[None]],
        query: Tensor,
        key: Tensor,
        value: Tensor,
        dropout: float,
        scaling: float | None,
    ) -> Tensor:
        q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in (query, key, value))
        # Record a graph only when some input needs a gradient (not in eval / no_grad).
        track = any(ctx.needs_input_grad[1:4])
        with torch.enable_grad() if track else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=scaling
            )
        inputs = (q, k, v)
        ctx.reenter, ctx.inputs, ctx.out = reenter, inputs, out
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        inputs: tuple[Tensor, ...] = ctx.inputs
        wanted = [t for t in inputs if t.requires_grad]
        with ctx.reenter():
            grads = iter(torch.autograd.grad(ctx.out, wanted, grad_out))
        ctx.inputs = ctx.out = None
        return (None, *(next(grads) if t.requires_grad else None for t in inputs), None, None)


#: What torch's ring kernels cannot honour.
LIMITS = Limits(
    name="torch's ring attention",
    mask_source="it supports plain causal attention only",
    sliding_window=False,
    bidirectional=False,
)


def _ring_kernel(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    args: AttentionArgs,
    *,
    reenter: Callable[[], contextlib.AbstractContextManager[None]],
) -> Tensor:
    if key.shape[1] != query.shape[1]:
        # torch's ring kernels need equal head counts and its CP dispatcher does not honour
        # enable_gqa (on an H200 with torch 2.11 it found no fp32 kernel), so the KV heads are
        # expanded here; autograd sums their gradients back. (The wrong gradients seen there
        # came from the backward running outside torch's context: see _RingSDPA.)
        repeats = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)
    out: Tensor = _RingSDPA.apply(reenter, query, key, value, args.dropout, args.scale)
    return out


def hf_ring_attention(
    *args: Any,
    reenter: Callable[[], contextlib.AbstractContextManager[None]],
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Hand causal SDPA to torch's CP dispatcher (a transformers attention function).

    Args:
        *args: transformers' call: ``module, query [B, H, S, D] (head/tail layout), key and
            value [B, Hkv, S, D], attention_mask (must be None), dropout, scaling,
            sliding_window (must be None)``; the module must be causal.
        reenter: returns torch's ring context again, for the backward pass.
        **kwargs: the rest of transformers' call, by name.

    Returns:
        ([B, S, H, D], None).
    """
    kernel = functools.partial(_ring_kernel, reenter=reenter)
    return hf_attention(kernel, LIMITS)(*args, **kwargs)


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
    from cp_sharder.attention.overrides import hf_attention_override

    def reenter() -> contextlib.AbstractContextManager[None]:
        return torch_ring_context(cp, padded_len)

    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if hf:
                attention = functools.partial(hf_ring_attention, reenter=reenter)
                stack.enter_context(hf_attention_override(model, HF_ATTENTION_KEY, attention))
            stack.enter_context(reenter())
            yield

    return ctx
