"""Activation checkpointing per decoder layer.

Forward keeps only each checkpointed layer's inputs; backward recomputes its activations.

The layer's ``forward`` is wrapped (``torch.utils.checkpoint.checkpoint``, non-reentrant), not
the module: parameter names stay as they are (no ``_checkpoint_wrapped_module.``), so Engine
checkpoints and the Hugging Face export are unchanged, exactly as for the compiled layers.
Because the wrapper lives inside ``forward``, FSDP2's per-layer hooks (all-gather before the
forward, before the recomputation in backward, and reduce-scatter after) stay outside it, and
torch.compile traces the checkpointed forward as one region (torchtitan's order: checkpoint,
then compile, then FSDP2).

The recomputation runs in backward, after cp-sharder's ``train_ctx`` (packed rows, cp > 1)
has been left: cp-sharder's ``checkpoint_context_fn`` re-enters the step's context around it,
so the recomputed attention is routed exactly as the forward's was.

With compile, the two wrappers nest in one of two orders (:func:`checkpoint_and_compile`).
torchtitan's (compile outside, tracing ``checkpoint`` as one higher-order op whose backward
replays the traced graph) holds only while dynamo traces the whole layer. A graph break inside
the layer (cp-sharder's per-document attention is excluded from compile on purpose; MoE
dispatch and vision towers may break too) makes dynamo run ``checkpoint`` eagerly: the forward
then runs compiled pieces while the recomputation in backward, outside compile, runs the layer
eagerly and without the step's attention routing, and torch raises "a different number of
tensors was saved". Those layers are checkpointed around the compiled forward instead: the
checkpoint is eager, and its forward and its recomputation call the same compiled code inside
the same attention routing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from train_recipes.model.build import compile_decoder_layers, decoder_layers

__all__ = ["apply_activation_checkpointing", "checkpoint_and_compile"]

logger = logging.getLogger(__name__)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _checkpointed(forward: Callable[_P, _R]) -> Callable[_P, _R]:
    from torch.utils.checkpoint import checkpoint

    from cp_sharder import checkpoint_context_fn

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:  # the layer's arguments, passed on as they are
        # Non-reentrant: works with keyword arguments, inputs that need no gradient and
        # torch.compile; the RNG state is replayed so dropout masks are the same.
        if torch.compiler.is_compiling():
            # Compiled, the recomputation replays the traced graph (attention routed as it was
            # when traced) and context_fn may only return dispatch modes.
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=checkpoint_context_fn, **kwargs
        )

    return run


def apply_activation_checkpointing(model: nn.Module, *, every: int = 1) -> int:
    """Checkpoint decoder layers 0, ``every``, 2 * ``every``, ... in place.

    Call before compile and before FSDP2 wrapping. Layers are the classes in the model's
    ``_no_split_modules`` (for a VLM that includes the vision blocks), in module order.

    Args:
        model: a transformers model (plain, not yet wrapped).
        every: checkpoint one layer in ``every`` (1: all layers). A larger value trades memory
            for less recomputation.

    Returns:
        The number of layers checkpointed.

    Raises:
        ValueError: ``every`` < 1, or no decoder layers found.
    """
    if every < 1:
        raise ValueError(
            f"activation checkpointing every={every}: must be >= 1 (1 checkpoints every layer)"
        )
    layers = decoder_layers(model)
    chosen = layers[::every]
    for layer in chosen:
        layer.forward = _checkpointed(layer.forward)
    logger.info("activation checkpointing on %d of %d decoder layers", len(chosen), len(layers))
    return len(chosen)


def checkpoint_and_compile(
    model: nn.Module,
    *,
    checkpoint_every: int | None,
    compile_layers: bool,
    traced_whole: bool,
    backend: str = "inductor",
    memory_budget: float | None = None,
) -> None:
    """Checkpoint and/or compile the decoder layers in place, nested in the order that works.

    Call before FSDP2 wrapping.

    Args:
        model: a transformers model (plain, not yet wrapped).
        checkpoint_every: checkpoint one layer in this many (None: no checkpointing).
        compile_layers: compile each decoder layer's forward.
        traced_whole: dynamo traces a layer without a graph break (dense text, rows not
            packed, cp=1). Then the checkpoint is compiled with the layer (torchtitan's order:
            the recomputation is part of the compiled backward); otherwise it wraps the
            compiled forward (see the module docstring).
        backend: the torch.compile backend.
        memory_budget: see :func:`train_recipes.model.build.compile_decoder_layers`.
    """
    if checkpoint_every is not None and traced_whole:
        apply_activation_checkpointing(model, every=checkpoint_every)
    if compile_layers:
        compile_decoder_layers(model, backend=backend, memory_budget=memory_budget)
    if checkpoint_every is not None and not traced_whole:
        apply_activation_checkpointing(model, every=checkpoint_every)
