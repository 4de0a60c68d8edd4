"""Attention backend choice and the ``train_ctx`` that enters it, per step.

Rules for the SDPA family (transformers models without TE modules or a model hook, and plain
PyTorch models calling ``F.scaled_dot_product_attention``):

==========================================  ==============================================
batch                                       backend
==========================================  ==============================================
packed THD (any cp)                         VARLEN (varlen attention, all-gather K/V at cp>1)
[B, S] rows packed by position restarts,    VARLEN (any cp)
right padding only
cp=1, other [B, S] batches                  NONE (the model runs unchanged)
cp>1, plain causal (no documents, padding   TORCH_RING on a CUDA mesh for transformers models
only after the last real token, no          when each head/tail chunk is a multiple of 32
sliding window)                             tokens; else PORTABLE
anything else                               PORTABLE (mask by global index)
==========================================  ==============================================

Activation checkpointing: a checkpointed layer recomputes its forward during backward, after
``train_ctx`` has been left, so its attention would run unrouted (the model's own SDPA on the
local shard: wrong gradients). Entering a ``train_ctx`` records it (a context variable, set
only inside the block); :func:`checkpoint_context_fn`, given to torch's non-reentrant
``checkpoint(..., context_fn=...)``, captures it at forward time and re-enters the same step's
context around the recomputation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, ParamSpec

import torch
from torch import Tensor

from cp_sharder._dist import CPGroup
from cp_sharder.attention import Backend
from cp_sharder.planning import BatchPlan, TrainContext

__all__ = ["build_context", "checkpoint_context_fn", "pick_backend"]

# Tokens per head/tail chunk that torch's ring attention needs a multiple of: its ring merges
# per-chunk log-sum-exps that its memory-efficient kernel pads to a multiple of 32 rows (on an
# H200 with torch 2.11, P=16 at cp=2 failed inside torch's merge).
RING_CHUNK_ALIGN = 32

_P = ParamSpec("_P")


def pick_backend(
    plan: BatchPlan,
    *,
    family: Backend,
    cp: CPGroup,
    hf: bool,
    sliding_window: bool,
) -> Backend:
    """The backend of this step (see the module table)."""
    if family is not Backend.PORTABLE:
        return family
    if plan.thd or (plan.segment_ids is not None and plan.right_padded):
        return Backend.VARLEN
    if cp.size == 1:
        return Backend.NONE
    plain_causal = plan.doc_ids is None and plan.right_padded and not sliding_window
    mesh_type = getattr(cp.mesh, "device_type", "cpu")
    # Only transformers models: their attention call goes through torch_ring's autograd
    # wrapper, which re-enters torch's ring dispatch for backward. A plain model's own SDPA
    # call would run backward outside train_ctx and get local-only gradients.
    ring_aligned = plan.sequence.padded_seq_len % (RING_CHUNK_ALIGN * 2 * cp.size) == 0
    if plain_causal and ring_aligned and hf and mesh_type == "cuda":
        return Backend.TORCH_RING
    return Backend.PORTABLE


def _hf_or_sdpa(
    model: torch.nn.Module, hf: bool, key: str, hf_fn: Any, sdpa_fn: Any
) -> TrainContext:
    from cp_sharder.attention.overrides import hf_attention_override, sdpa_replaced

    if hf:
        return lambda: hf_attention_override(model, key, hf_fn)
    return lambda: sdpa_replaced(sdpa_fn)


# The train_ctx factory whose block is running now (innermost), None outside every one.
_ACTIVE_TRAIN_CTX: ContextVar[TrainContext | None] = ContextVar(
    "cp_sharder_active_train_ctx", default=None
)


def _recorded(factory: TrainContext) -> TrainContext:
    """``factory`` that also marks itself active while its block runs."""

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        token = _ACTIVE_TRAIN_CTX.set(factory)
        try:
            with factory():
                yield
        finally:
            _ACTIVE_TRAIN_CTX.reset(token)

    return enter


def checkpoint_context_fn() -> tuple[
    contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]
]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    Called by torch at forward time: the forward runs as it is (already inside ``train_ctx``)
    and the recomputation in backward re-enters the ``train_ctx`` active at that forward (the
    same step's attention routing and plans), or nothing when the forward ran outside one.
    Recomputation is collective exactly when the forward was (every CP rank recomputes the
    same layers in the same order).

    Returns:
        (forward context, recomputation context).
    """
    active = _ACTIVE_TRAIN_CTX.get()
    return contextlib.nullcontext(), (active() if active is not None else contextlib.nullcontext())


def _marks_active(build: Callable[_P, TrainContext]) -> Callable[_P, TrainContext]:
    """``build`` whose returned factories also mark themselves active (see :func:`_recorded`)."""

    @functools.wraps(build)
    def build_recorded(*args: _P.args, **kwargs: _P.kwargs) -> TrainContext:
        return _recorded(build(*args, **kwargs))

    return build_recorded


@_marks_active
def build_context(
    plan: BatchPlan,
    backend: Backend,
    *,
    model: torch.nn.Module,
    cp: CPGroup,
    hf: bool,
    local_index: Tensor,
    all_index: Tensor,
    inverse_index: Tensor,
    attach_te: Callable[[], None],
) -> TrainContext:
    """The ``train_ctx`` factory of this step.

    Entering the context marks it active for :func:`checkpoint_context_fn`.

    Args:
        plan: the step's batch plan.
        backend: from :func:`pick_backend`.
        model: the live model.
        cp: the CP group.
        hf: whether the model is a transformers model.
        local_index: [P/W] global positions of this rank's tokens.
        all_index: [W, P/W] every rank's global positions.
        inverse_index: [P] slot of each global position in rank-order gathered tokens.
        attach_te: gives TE modules the CP group (idempotent).
    """
    if backend is Backend.MODEL_HOOK:
        return plan.hook_context or contextlib.nullcontext
    if backend is Backend.NONE:
        return contextlib.nullcontext
    if backend is Backend.TE:
        if cp.size > 1:
            attach_te()
        return contextlib.nullcontext
    if backend is Backend.TORCH_RING:
        from cp_sharder.attention import torch_ring

        return torch_ring.make_context(model, cp, hf, plan.sequence.padded_seq_len)
    if backend is Backend.VARLEN:
        from cp_sharder.attention import packed

        assert plan.segment_ids is not None
        attention = packed.PackedAttention(
            segment_ids=plan.segment_ids,
            local_index=local_index.cpu(),
            inverse_index=inverse_index.cpu(),
            cp=cp,
        )
        # Built now, on CPU, so the forward needs no host sync for the common causal case.
        primary = plan.tensors.get("input_ids", plan.tensors.get("inputs_embeds"))
        assert primary is not None
        attention.plan(rows=int(primary.shape[0]), causal=True, device=torch.device("cpu"))
        return _hf_or_sdpa(
            model,
            hf,
            packed.HF_ATTENTION_KEY,
            packed.make_hf_attention(attention),
            packed.sdpa_attention(attention),
        )
    from cp_sharder.attention import portable

    spec = portable.MaskSpec(
        q_index=local_index,
        k_index=all_index.reshape(-1),
        doc_ids=plan.doc_ids,
        key_valid=plan.key_valid,
    )
    if hf:
        fn = portable.make_hf_attention(spec, cp)
        return lambda: portable.hf_attention_override(model, portable.HF_ATTENTION_KEY, fn)
    return lambda: portable.sdpa_override(spec, cp)
