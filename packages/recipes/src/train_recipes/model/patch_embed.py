"""The VLM vision tower's patch embedding as one matmul instead of a Conv3d.

# P patches, K values per patch (channels x frames x patch x patch), E embedding width

Qwen2-VL-family towers embed each flattened patch with an ``nn.Conv3d`` whose kernel equals its
stride and its input: the convolution is a [P, K] x [K, E] matmul. cuDNN has no good algorithm
for that degenerate shape in bf16 on some GPU / cuDNN versions (transformers issue 45750 reports
orders of magnitude against the matmul; vLLM and SGLang substitute a linear layer for it), and its
weight gradient is a convolution backward too. :func:`use_linear_patch_embed` makes the module's
forward ``F.linear`` on a view of the same weight: parameters, state-dict names and checkpoints
are unchanged; only the order of the K-term sums differs.
"""

from __future__ import annotations

import types
from typing import Protocol

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["use_linear_patch_embed"]

# Patch embeddings whose forward was read: view the input as [P, C, t, p, p], Conv3d, view as
# [P, E] (transformers 5.17-5.22).
_SUPPORTED = frozenset({"Qwen2_5_VisionPatchEmbed"})


class _PatchEmbed(Protocol):
    proj: nn.Conv3d  # kernel == stride == the patch (see _degenerate)


def _linear_forward(self: _PatchEmbed, hidden_states: Tensor) -> Tensor:
    """[P, K] flattened patches (channel, frame, row, column order) -> [P, E]."""
    weight = self.proj.weight  # [E, C, t, p, p]: flattened in the same order as the patches
    x = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    return F.linear(x, weight.reshape(weight.shape[0], -1), self.proj.bias)


def _degenerate(conv: object) -> bool:
    return (
        isinstance(conv, nn.Conv3d)
        and tuple(conv.kernel_size) == tuple(conv.stride)
        and all(p == 0 for p in conv.padding)
        and tuple(conv.dilation) == (1, 1, 1)
        and conv.groups == 1
    )


def use_linear_patch_embed(model: nn.Module) -> int:
    """Run every supported patch embedding of ``model`` as a matmul (in place; idempotent).

    Args:
        model: a transformers image-text model, or a wrapper around one.

    Returns:
        The number of patch embeddings switched (0: none found, e.g. a text model).
    """
    switched = 0
    for module in model.modules():
        if type(module).__name__ in _SUPPORTED and _degenerate(getattr(module, "proj", None)):
            # An instance attribute: the class (and other models) keep the Conv3d forward.
            module.forward = types.MethodType(_linear_forward, module)
            switched += 1
    return switched
