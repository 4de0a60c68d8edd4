"""Transformer Engine context parallelism (extra ``cp-sharder[te]``, imported lazily).

TE attention modules run the CP exchange themselves; the sharder only lays the tokens out
(head/tail for BSHD, TE's per-sequence partition for THD), hands TE the CP group and
communication type, and passes the padded ``cu_seqlens`` of a packed batch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from cp_sharder._dist import CPGroup

logger = logging.getLogger(__name__)


def is_te_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Transformer Engine attention module (checked without importing TE)."""
    cls = type(module)
    return cls.__module__.startswith("transformer_engine") and hasattr(
        module, "set_context_parallel_group"
    )


def te_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every TE attention module of ``model``."""
    return [m for m in model.modules() if is_te_attention(m)]


def _require_te() -> Any:
    try:
        import transformer_engine.pytorch as te
    except ImportError as err:
        raise ImportError(
            "the model uses Transformer Engine attention but transformer_engine is not importable; "
            "install the extra: pip install 'cp-sharder[te]'"
        ) from err
    return te


def comm_type_for(module: torch.nn.Module) -> str:
    """``p2p`` ring by default; ``all_gather`` for sliding-window modules (TE's p2p cannot window)."""
    window = getattr(module, "window_size", None)
    if window is not None and tuple(window) not in ((-1, -1), (-1, 0)):
        return "all_gather"
    return "p2p"


def attach(model: torch.nn.Module, cp: CPGroup) -> None:
    """Give every TE attention module of ``model`` the CP group and its communication type.

    Raises:
        ImportError: Transformer Engine is missing (names the ``te`` extra).
        ValueError: the heads of a module are not divisible by the TP size.
    """
    _require_te()
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(cp.group) if cp.group is not None else [0]
    stream = torch.cuda.Stream()
    tp = cp.tp_mesh.size() if cp.tp_mesh is not None else 1
    for module in te_attention_modules(model):
        heads = getattr(module, "num_attention_heads", None)
        if heads is not None and heads % tp:
            raise ValueError(
                f"{type(module).__name__} has {heads} attention heads, not divisible by tp={tp}"
            )
        comm = comm_type_for(module)
        setter: Any = module.set_context_parallel_group
        setter(cp.group, ranks, stream, cp_comm_type=comm)
        logger.debug("TE CP attached to %s with cp_comm_type=%s", type(module).__name__, comm)


def thd_batch_keys(cu_seqlens_padded: torch.Tensor, max_seqlen: int) -> dict[str, Any]:
    """The packed-sequence keys TE-backed models read: padded cu_seqlens (int32) and max length."""
    cu = cu_seqlens_padded.to(torch.int32)
    return {
        "qkv_format": "thd",
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": cu,
        "cu_seqlens_kv_padded": cu,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_kv": max_seqlen,
    }
