"""Pure routing index math: expert ownership, sorting by expert, load counts. No process groups.

# T tokens, H hidden, K top-k, E experts, W expert-parallel ranks, N routed (token, expert) pairs
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The one "routes nowhere" id, shared by padding rows and by router replay's "route live" rows.
NO_EXPERT = -1


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """Experts owned by ``ep_rank``: the contiguous block ``[start, end)``.

    Rank r owns experts ``r*E/W`` to ``(r+1)*E/W - 1``.

    Raises:
        ValueError: E is not divisible by W, or the rank is out of range.
    """
    if ep_size < 1:
        raise ValueError(f"expert-parallel size must be >= 1, got {ep_size}")
    if num_experts % ep_size != 0:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}; "
            f"choose an expert-parallel group whose size divides {num_experts}"
        )
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} is outside [0, {ep_size})")
    per_rank = num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def check_routing_shapes(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> None:
    """Check the shapes and dtypes shared by every dispatcher's ``dispatch``.

    Args:
        hidden: [T, H].
        topk_ids: [T, K], integer.
        topk_weights: [T, K], floating point.
    """
    if hidden.dim() != 2:
        raise ValueError(
            f"hidden must be [T, H], got shape {tuple(hidden.shape)}; flatten batch and "
            "sequence first (hidden.reshape(-1, H))"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"topk_ids must be [T, K] with T={hidden.shape[0]} (hidden's rows), "
            f"got shape {tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape "
            f"{tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")


def validate_topk_ids(topk_ids: Tensor, num_experts: int) -> None:
    """Raise if any id is outside ``[-1, E)`` (one host sync).

    Args:
        topk_ids: [T, K]; -1 marks a slot that routes nowhere.
        num_experts: E, the global experts.
    """
    if topk_ids.numel() == 0:
        return
    bad = (topk_ids < NO_EXPERT) | (topk_ids >= num_experts)
    if bool(bad.any()):
        value = int(topk_ids[bad][0])
        raise ValueError(
            f"topk_ids holds expert id {value}, outside [-1, {num_experts}); ids must index the "
            f"{num_experts} global experts, with -1 for slots that route nowhere (padding)"
        )


def sort_by_expert(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Order the routed (token, slot) pairs by expert, skipping -1 slots.

    Args:
        topk_ids: [T, K], ids in ``[-1, E)``.
        num_experts: E, the global experts.

    Returns:
        slots: [N] int64 flat indices into ``topk_ids.reshape(-1)``, grouped by expert in
            increasing order and, within an expert, by token (a stable sort). ``slots // K`` is
            the token row.
        counts: [E] int64, pairs per expert (padding slots excluded).
    """
    flat = topk_ids.reshape(-1)
    slots = (flat >= 0).nonzero().squeeze(1)
    ids = flat.index_select(0, slots).long()
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=num_experts)
    return slots.index_select(0, order), counts


def expert_load(topk_ids: Tensor, num_experts: int) -> Tensor:
    """Routed pairs per expert, counting only real slots (padding's -1 is excluded).

    Args:
        topk_ids: [T, K].
        num_experts: E, the global experts.

    Returns:
        [E] int64.
    """
    flat = topk_ids.reshape(-1)
    return torch.bincount(flat[flat >= 0].long(), minlength=num_experts)


def load_balancing_loss(router_probs: Tensor, topk_ids: Tensor) -> Tensor:
    """Switch-style auxiliary loss ``E * sum_e f_e * P_e`` over real tokens only.

    A row whose ids are all -1 (padding) counts neither in the load fractions ``f`` nor in the
    mean probabilities ``P``, so padding changes neither the loss nor its gradient.

    Args:
        router_probs: [T, E], the full softmax of the router (differentiable).
        topk_ids: [T, K].

    Returns:
        [] scalar in router_probs' dtype; 0 when no row is real.
    """
    num_experts = router_probs.shape[-1]
    real = (topk_ids >= 0).any(dim=1)
    num_real = real.sum()
    load = expert_load(topk_ids, num_experts).to(router_probs.dtype)
    denom = num_real.clamp(min=1).to(router_probs.dtype)
    fraction = load / (denom * topk_ids.shape[1])
    mean_prob = (router_probs * real.unsqueeze(1).to(router_probs.dtype)).sum(0) / denom
    return num_experts * (fraction * mean_prob).sum()


def group_major_to_expert_major(counts: Tensor, total: int | None = None) -> Tensor:
    """Permutation that turns a [source, expert]-blocked layout into [expert, source] blocks.

    Args:
        counts: [W, E_local] int64; rows of the input arrive as W blocks (one per source rank),
            each holding E_local sub-blocks of ``counts[w, e]`` rows.
        total: ``counts.sum()`` if the caller already has it on the host (saves a sync).

    Returns:
        [N] int64 ``index`` such that ``x.index_select(0, index)`` lists expert 0's rows (from
        every source in rank order), then expert 1's, and so on.
    """
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(counts.shape)
    lengths = counts.t().reshape(-1)
    block_starts = starts.t().reshape(-1)
    if total is None:
        total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=counts.device)
    out_starts = torch.cumsum(lengths, 0) - lengths
    base = torch.repeat_interleave(block_starts - out_starts, lengths, output_size=total)
    return base + torch.arange(total, device=counts.device)


def inverse_permutation(index: Tensor) -> Tensor:
    """The permutation ``inv`` with ``inv[index[i]] = i``.

    Args:
        index: [N] int64 permutation of ``range(N)``.
    """
    inv = torch.empty_like(index)
    inv[index] = torch.arange(index.numel(), device=index.device)
    return inv
