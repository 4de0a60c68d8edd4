"""Activation checkpointing per decoder layer.

Forward keeps only each checkpointed layer's inputs; backward recomputes its activations.

The layer's ``forward`` is wrapped (``torch.utils.checkpoint.checkpoint``, non-reentrant), not
the module: parameter names stay as they are (no ``_checkpoint_wrapped_module.``), so Engine
checkpoints and the Hugging Face export are unchanged, exactly as for the compiled layers.
Because the wrapper lives inside ``forward``, FSDP2's per-layer hooks (all-gather before the
forward, before the recomputation in backward, and reduce-scatter after) stay outside it, and
torch.compile traces the checkpointed forward as one region (torchtitan's order: checkpoint,
then compile, then FSDP2).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from torch import nn

from train_recipes.modeling import decoder_layers

__all__ = ["apply_activation_checkpointing"]

logger = logging.getLogger(__name__)


def _checkpointed(forward: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword arguments, inputs that need no gradient and
        # torch.compile; the RNG state is replayed so dropout masks are the same.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

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
