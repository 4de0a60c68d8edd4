"""Activation checkpointing inside ``train_ctx``: a checkpointed layer recomputes its forward
in backward, after ``train_ctx`` was left; ``checkpoint_context_fn`` must re-enter the step's
context so the recomputation is routed like the forward (packed rows: per-document attention).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

import _packed_workers as workers
from cp_sharder import checkpoint_context_fn


def _checkpoint_layers(model: torch.nn.Module, context_fn: Any) -> None:
    for layer in model.model.layers:
        forward = layer.forward

        def run(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        layer.forward = functools.wraps(forward)(run)


def _no_contexts() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def test_recomputation_in_backward_is_routed_like_the_forward() -> None:
    _, real, padded, seq = workers.CASES[0]
    batch, docs = workers.packed_batch(real, padded, seq, seed=7)
    batch["use_cache"] = False  # a KV cache would grow again in each recomputation
    model = workers.tiny_model("llama")
    ref_loss, ref = workers.reference(model, docs)
    checkpointed = workers.tiny_model("llama")
    _checkpoint_layers(checkpointed, checkpoint_context_fn)
    loss, grads, backend, _ = workers.packed_step(checkpointed, None, batch)
    assert backend == "varlen"
    routed = workers.compare(loss, grads, ref_loss, ref)
    assert routed["loss_rel_err"] < 1e-9 and routed["grad_rel_err"] < 1e-9, routed
    assert not routed["missing_grads"], routed

    # The teeth: recomputed outside the context (the model's own attention over the whole
    # row), the recomputation is another function: torch's checkpoint notices the saved
    # tensors differ, or the gradients are wrong.
    unrouted = workers.tiny_model("llama")
    _checkpoint_layers(unrouted, _no_contexts)
    try:
        loss, grads, _, _ = workers.packed_step(unrouted, None, batch)
    except CheckpointError:
        return
    assert workers.compare(loss, grads, ref_loss, ref)["grad_rel_err"] > 1e-3


def test_outside_train_ctx_both_contexts_are_empty() -> None:
    forward_ctx, recompute_ctx = checkpoint_context_fn()
    assert isinstance(forward_ctx, contextlib.nullcontext)
    assert isinstance(recompute_ctx, contextlib.nullcontext)
