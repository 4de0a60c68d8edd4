"""Collecting the routing of a model's MoE layers, and the router losses computed from it.

# T tokens, E experts, K top-k, L MoE layers
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from moe_dispatch.moe import ExpertParallelMoE
from moe_dispatch.router import RouterOutput


@contextlib.contextmanager
def collect_routing(*models: nn.Module) -> Iterator[list[RouterOutput]]:
    """Collect the :class:`RouterOutput` of every MoE layer's forward inside the context.

    Activation-checkpoint recomputation (during backward) is not collected again, so one
    forward gives one entry per layer call, in call order.

    Example::

        with collect_routing(model) as routing:
            logits = model(input_ids).logits
        aux = sum(load_balancing_loss(r.probs, r.topk_ids) for r in routing)

    Yields:
        The list the layers append to.
    """
    layers = [m for model in models for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    busy = [m for m in layers if m.routing_sink is not None]
    if busy:
        raise RuntimeError("collect_routing contexts do not nest; leave the outer one first")
    sink: list[RouterOutput] = []
    for layer in layers:
        layer.routing_sink = sink
    try:
        yield sink
    finally:
        for layer in layers:
            layer.routing_sink = None


def router_z_loss(logits: Tensor, topk_ids: Tensor | None = None) -> Tensor:
    """ST-MoE's router z-loss ``mean_t logsumexp(logits_t)^2`` over real tokens.

    Args:
        logits: [T, E] router logits.
        topk_ids: [T, K]; rows whose ids are all -1 (padding) are left out. None counts all.

    Returns:
        [] float32 scalar; 0 when no row is real.
    """
    z = torch.logsumexp(logits.float(), dim=-1).pow(2)
    if topk_ids is None:
        return z.mean() if z.numel() else z.sum()
    real = (topk_ids >= 0).any(dim=1)
    return (z * real).sum() / real.sum().clamp(min=1)
