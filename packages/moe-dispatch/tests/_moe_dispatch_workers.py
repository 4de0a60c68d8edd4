"""Functions run inside spawned gloo ranks (kept light: torch and moe_dispatch only)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from _moe_dispatch_ref import Case, make_weights
from moe_dispatch import (
    AllToAllDispatcher,
    Dispatcher,
    EqualizingDispatcher,
    ExpertParallelMoE,
    HybridEPDispatcher,
    MoEConfig,
    equalize_token_counts,
    expert_load,
    padded_token_count,
)


def _local_slice(case: Case, rank: int) -> slice:
    start = sum(case.counts[:rank])
    return slice(start, start + case.counts[rank])


def _run_moe(
    case: Case,
    rank: int,
    dispatcher: Dispatcher,
    device: str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    w = make_weights(case)
    moe = ExpertParallelMoE(case, dispatcher=dispatcher)
    with torch.no_grad():
        moe.router.weight.copy_(w.router)
    moe.load_experts(w.gate_up, w.down)
    moe.to(device=device, dtype=dtype)
    rows = _local_slice(case, rank)
    x = w.x[rows].to(device=device, dtype=dtype).requires_grad_()
    out, routing = moe.forward_with_routing(x)
    (out * w.grad_out[rows].to(device=device, dtype=dtype)).sum().backward()
    assert x.grad is not None and moe.router.weight.grad is not None
    assert moe.experts.gate_up_proj.grad is not None and moe.experts.down_proj.grad is not None
    router_grad = moe.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # the router is replicated; each rank saw its own tokens
    result = {
        "out": out.detach(),
        "ids": routing.topk_ids,
        "x": x.grad,
        "router": router_grad,
        "gate_up": moe.experts.gate_up_proj.grad,
        "down": moe.experts.down_proj.grad,
    }
    return {
        key: value.cpu() if key == "ids" else value.cpu().float() for key, value in result.items()
    }


def check_moe_cases(
    rank: int, world_size: int, cases: list[Case], device: str = "cpu"
) -> list[dict[str, Any]]:
    """For each case: the plain all-to-all run, the equalized run, and dispatch statistics."""
    torch.manual_seed(1234 + rank)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    results: list[dict[str, Any]] = []
    for case in cases:
        assert len(case.counts) == world_size
        plain = _run_moe(case, rank, AllToAllDispatcher(None, case.num_experts), device)
        padded = _run_moe(
            case,
            rank,
            EqualizingDispatcher(AllToAllDispatcher(None, case.num_experts), alignment=4),
            device,
        )
        stats = _equalize_stats(case, rank, device)
        results.append({"plain": plain, "padded": padded, "stats": stats})
    return results


def _equalize_stats(case: Case, rank: int, device: str) -> dict[str, Any]:
    """Dispatch the padded tokens directly and report what reached the experts."""
    w = make_weights(case)
    rows = _local_slice(case, rank)
    x = w.x[rows].to(device)
    probs = torch.softmax(x @ w.router.t().to(device), dim=-1)
    weights, ids = torch.topk(probs, case.top_k, dim=-1)
    padded = equalize_token_counts(x, ids, weights, alignment=4)
    fixed = equalize_token_counts(
        x, ids, weights, padded_size=padded_token_count(x.shape[0], alignment=8, device=x.device)
    )
    dispatcher = AllToAllDispatcher(None, case.num_experts)
    # Mark padding rows so any that reached an expert would be visible.
    marked = padded.hidden.clone()
    marked[padded.num_tokens :] = float("nan")
    expert_input, counts, _ = dispatcher.dispatch(marked, padded.topk_ids, padded.topk_weights)
    sizes = [0] * dist.get_world_size()
    dist.all_gather_object(sizes, padded.padded_size)
    return {
        "padded_size": padded.padded_size,
        "all_padded_sizes": sizes,
        "fixed_size": fixed.padded_size,
        "nan_rows_at_experts": int(torch.isnan(expert_input).any(dim=1).sum()),
        "rows_at_experts": int(expert_input.shape[0]),
        "counts": counts.cpu(),
        "load_padded": expert_load(padded.topk_ids, case.num_experts).cpu(),
        "load_real": expert_load(ids, case.num_experts).cpu(),
        "pad_ids": padded.topk_ids[padded.num_tokens :].cpu(),
        "pad_weights": padded.topk_weights[padded.num_tokens :].cpu(),
    }


def check_hf_conversion(rank: int, world_size: int, seed: int) -> dict[str, Tensor]:
    """Convert tiny HF Mixtral / Qwen2-MoE blocks to expert-parallel layers on this group."""
    from _moe_dispatch_hf import build_block
    from moe_dispatch import from_hf_moe_block

    out: dict[str, Tensor] = {}
    for kind in ("mixtral", "qwen2_moe"):
        block = build_block(kind, seed=seed)
        counts = [5, 0, 9, 2][:world_size]
        g = torch.Generator().manual_seed(seed + 1)
        x_all = torch.randn(sum(counts), block.gate.weight.shape[1], generator=g)
        start = sum(counts[:rank])
        x = x_all[start : start + counts[rank]].reshape(1, counts[rank], x_all.shape[-1])
        with torch.no_grad():
            want = block(x_all.reshape(1, -1, x_all.shape[-1]))[0, start : start + counts[rank]]
        moe = from_hf_moe_block(
            block, dispatcher=AllToAllDispatcher(None, block.gate.weight.shape[0]), layer_id=0
        )
        with torch.no_grad():
            got = moe(x)[0]
        out[kind] = (got - want).abs().max() if got.numel() else torch.tensor(0.0)
    return out


def check_hybrid_ep(rank: int, world_size: int, case: Case) -> dict[str, dict[str, Tensor]]:
    """bf16 MoE through HybridEP and through the NCCL all-to-all, same weights and tokens."""

    torch.cuda.set_device(rank % torch.cuda.device_count())
    a2a = _run_moe(case, rank, AllToAllDispatcher(None, case.num_experts), "cuda", torch.bfloat16)
    hybrid = _run_moe(
        case, rank, HybridEPDispatcher(None, case.num_experts), "cuda", torch.bfloat16
    )
    return {"a2a": a2a, "hybrid": hybrid}


def check_failures_are_agreed(rank: int, world_size: int) -> list[Any]:
    """Bad input on one rank makes every rank raise (no hang); the group stays usable."""
    from moe_dispatch import RouterReplay

    torch.manual_seed(rank)
    experts, hidden = 4, 6
    messages: list[Any] = []
    dispatcher = AllToAllDispatcher(None, experts)
    ids = torch.zeros(3, 2, dtype=torch.long)
    if rank == 1:
        ids[0, 0] = experts  # out of range on rank 1 only
    try:
        dispatcher.dispatch(torch.randn(3, hidden), ids, torch.rand(3, 2))
        messages.append(None)
    except ValueError as err:
        messages.append(str(err))
    from _moe_dispatch_emulated_hybrid import EmulatedHybridEPBuffer

    # The router fails on rank 0 only: its dispatcher's abort_dispatch tells the peers, which
    # raise in the padding exchange (both dispatchers pad before their first own collective).
    for dispatcher in (
        EqualizingDispatcher(AllToAllDispatcher(None, experts)),
        HybridEPDispatcher(None, experts, buffer_factory=EmulatedHybridEPBuffer),
    ):
        moe = ExpertParallelMoE(
            MoEConfig(
                hidden_size=hidden, intermediate_size=5, num_experts=experts, top_k=2, layer_id=0
            ),
            dispatcher=dispatcher,
        )
        replay = RouterReplay()
        replay.bind(moe)
        routes = torch.tensor([[0, 1]] * 5)
        if rank == 0:
            routes = torch.full((5, 2), 99)  # an invalid recording on rank 0 only
        try:
            with replay.replay({0: routes}):
                moe(torch.randn(5, hidden))
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
    check = torch.ones(1)
    dist.all_reduce(check)
    messages.append(int(check.item()))
    return messages


def check_emulated_hybrid_ep(rank: int, world_size: int, cases: list[Case]) -> list[Any]:
    """HybridEPDispatcher's wrapper logic over the emulated buffer (fp32, CPU)."""
    from _moe_dispatch_emulated_hybrid import EmulatedHybridEPBuffer

    results: list[Any] = []
    for case in cases:
        dispatcher = HybridEPDispatcher(
            None, case.num_experts, buffer_factory=EmulatedHybridEPBuffer
        )
        got = _run_moe(case, rank, dispatcher, "cpu")
        sizes = dispatcher._buffer.dispatch_sizes
        results.append({"grads": got, "sizes": sizes})
    return results
