"""Context-parallel attention backends and the rule that picks one from the live model.

- :mod:`cp_sharder.attention.portable`: all-gather-K/V attention in plain PyTorch (CPU and CUDA;
  causal, document and sliding-window masks).
- :mod:`cp_sharder.attention.varlen`: the variable-length (per-document) attention kernel.
- :mod:`cp_sharder.attention.packed`: packed attention for any layout (all-gather K/V, then
  varlen attention over per-document runs; CPU/gloo and CUDA/NCCL; no dense mask).
- :mod:`cp_sharder.attention.torch_ring`: torch's native ring attention (CUDA, plain causal).
- :mod:`cp_sharder.attention.te`: Transformer Engine (extra ``cp-sharder[te]``).
- :mod:`cp_sharder.attention.adapters`: the transformers and SDPA call signatures and their
  refusals, shared by the portable, packed and torch-ring backends.
- :mod:`cp_sharder.attention.overrides`: routes a model's attention to a backend inside
  ``train_ctx``.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from cp_sharder.attention.te import te_attention_modules

__all__ = ["Backend", "has_sliding_window", "is_hf_model", "model_hook", "select_family"]

#: Name of the model-owned preparation hook that takes over batch preparation.
HOOK_NAME = "prepare_model_inputs_for_cp"


class Backend(enum.Enum):
    """Which code runs attention across the CP ranks.

    Attributes:
        MODEL_HOOK: the model's own ``prepare_model_inputs_for_cp`` hook owns CP attention.
        TE: Transformer Engine attention modules.
        PORTABLE: all-gather-K/V attention in plain PyTorch, masked by global token index.
        VARLEN: per-document variable-length attention (packed batches; no dense mask).
        TORCH_RING: torch's native ring attention (CUDA, plain causal SDPA).
        NONE: cp=1 on a plain batch; the model runs unchanged.
    """

    MODEL_HOOK = "model_hook"
    TE = "te"
    PORTABLE = "portable"
    VARLEN = "varlen"
    TORCH_RING = "torch_ring"
    NONE = "none"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # DDP and similar wrappers keep the user's model in `.module`.
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def model_hook(model: torch.nn.Module) -> Any:
    """The model's ``prepare_model_inputs_for_cp`` bound method, or None."""
    hook = getattr(_unwrap(model), HOOK_NAME, None)
    return hook if callable(hook) else None


def is_hf_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers model (checked without importing transformers)."""
    return any(cls.__module__.startswith("transformers.") for cls in type(_unwrap(model)).__mro__)


def has_sliding_window(model: torch.nn.Module) -> bool:
    """Whether any transformers config of ``model`` enables sliding-window attention."""
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is None:
            continue
        layer_types = getattr(cfg, "layer_types", None) or ()
        if "sliding_attention" in layer_types:
            return True
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            return True
    return False


def select_family(model: torch.nn.Module) -> Backend:
    """The backend family of ``model``: hook > TE attention modules > SDPA (PORTABLE).

    Between the two SDPA backends the sharder picks per step (torch's ring needs CUDA and a
    plain causal batch); this function reports PORTABLE for the family.
    """
    if model_hook(model) is not None:
        return Backend.MODEL_HOOK
    if te_attention_modules(model):
        return Backend.TE
    return Backend.PORTABLE
