"""Section ``moe``: moe-dispatch's all-to-all dispatch + combine against a dense loop, and bandwidth."""

from __future__ import annotations

import importlib.util
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from train_testing.bench import free_memory, sync

from .harness import (
    Run,
    all_ok,
    barrier,
    phase,
    reduce_scalar,
    rel_err,
    table,
    write_section,
)

# moe: dispatch only moves rows; the combine accumulates in fp32.
MOE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _moe_counts(base: int, world: int) -> list[int]:
    """Unequal tokens per rank; with 3 or more ranks the last one holds none."""
    counts = [base - r * base // (2 * world) + 3 * r for r in range(world)]
    if world >= 3:
        counts[-1] = 0
    return counts


def _moe_global(run: Run, counts: list[int], hidden: int, dtype: torch.dtype) -> dict[str, Tensor]:
    """Global routing problem, identical on every rank (CPU generator, then moved)."""
    s = run.sizes
    e, k = s.moe_experts, s.moe_top_k
    total = sum(counts)
    g = torch.Generator().manual_seed(11)
    scores = torch.rand(total, e, generator=g)
    ids = scores.topk(k, dim=-1).indices
    ids[torch.rand(total, k, generator=g) < 0.05] = -1  # some slots route nowhere
    weights = torch.softmax(torch.randn(total, k, generator=g), dim=-1)
    return {
        "x": torch.randn(total, hidden, generator=g).to(run.dev, dtype),
        "ids": ids.to(run.dev),
        "w": weights.to(run.dev, dtype),
        "grad_out": torch.randn(total, hidden, generator=g).to(run.dev, dtype),
        # Expert e computes x * a[e] + b[e]: distinct per expert, so a row routed to the wrong
        # expert or a swapped token changes the result.
        "a": (1.0 + 0.1 * torch.randn(e, hidden, generator=g)).to(run.dev, dtype),
        "b": (0.1 * torch.randn(e, hidden, generator=g)).to(run.dev, dtype),
    }


def _moe_reference(glob: dict[str, Tensor], rows: slice) -> tuple[Tensor, Tensor, Tensor]:
    """Dense float64 loop over the top-k slots: out, d loss/d x, d loss/d w."""
    x = glob["x"][rows].double().requires_grad_()
    w = glob["w"][rows].double().requires_grad_()
    ids = glob["ids"][rows]
    a, b = glob["a"].double(), glob["b"].double()
    out = torch.zeros_like(x)
    for slot in range(ids.shape[1]):
        e = ids[:, slot]
        live = (e >= 0).double()[:, None]
        ec = e.clamp(min=0)
        out = out + live * w[:, slot : slot + 1] * (x * a[ec] + b[ec])
    (out * glob["grad_out"][rows].double()).sum().backward()
    assert x.grad is not None and w.grad is not None
    return out.detach(), x.grad, w.grad


def _moe_parity(
    run: Run, dispatcher: Any, dtype: torch.dtype, name: str, *, control: bool = False
) -> dict[str, Any]:
    """Dispatch, a distinct function per expert, combine, backward; vs the dense reference.

    ``control=True`` applies each row the function of the next expert (an ownership off by one),
    which the check must flag.
    """
    s = run.sizes
    counts = _moe_counts(s.moe_parity_tokens, run.world)
    glob = _moe_global(run, counts, s.moe_parity_hidden, dtype)
    start = sum(counts[: run.rank])
    rows = slice(start, start + counts[run.rank])
    x = glob["x"][rows].clone().requires_grad_()
    w = glob["w"][rows].clone().requires_grad_()
    expert_in, per_expert, handle = dispatcher.dispatch(x, glob["ids"][rows], w)
    first = dispatcher.local_expert_start
    local_ids = torch.repeat_interleave(
        torch.arange(first, first + dispatcher.num_local_experts, device=run.dev), per_expert
    )
    if control:
        local_ids = (local_ids + 1) % s.moe_experts
    y = expert_in * glob["a"][local_ids] + glob["b"][local_ids]
    out = dispatcher.combine(y, handle)
    (out.float() * glob["grad_out"][rows].float()).sum().backward()
    ref_out, ref_x, ref_w = _moe_reference(glob, rows)
    # Global per-expert counts: this rank's slice of them is what it must have received.
    all_ids = glob["ids"]
    global_counts = torch.bincount(all_ids[all_ids >= 0], minlength=s.moe_experts)
    want = global_counts[first : first + dispatcher.num_local_experts]
    assert x.grad is not None and w.grad is not None
    errs = {
        "out": rel_err(out, ref_out),
        "grad_x": rel_err(x.grad, ref_x),
        "grad_w": rel_err(w.grad, ref_w),
    }
    counts_ok = bool(torch.equal(per_expert.cpu(), want.cpu()))
    tol = MOE_TOL[dtype]
    ok = counts_ok and all(v < tol for v in errs.values())
    # Every rank must pass: reduce the worst error and the pass flag.
    worst = {k: reduce_scalar(run, v, dist.ReduceOp.MAX) for k, v in errs.items()}
    return {
        "dispatcher": name + (" (control: wrong expert)" if control else ""),
        "dtype": str(dtype).replace("torch.", ""),
        "tokens_per_rank": counts,
        "hidden": s.moe_parity_hidden,
        "counts_match": all_ok(run, counts_ok),
        **{f"{k}_rel_err": v for k, v in worst.items()},
        "tol": tol,
        "pass": all_ok(run, ok),
        "status": "ok",
    }


def _moe_bandwidth(run: Run, dispatcher: Any, tokens: int, hidden: int) -> dict[str, Any]:
    s = run.sizes
    dtype = torch.bfloat16 if run.device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(100 + run.rank)
    ids = torch.rand(tokens, s.moe_experts, generator=g).topk(s.moe_top_k, dim=-1).indices
    ids = ids.to(run.dev)
    w = torch.full((tokens, s.moe_top_k), 1.0 / s.moe_top_k, device=run.dev, dtype=dtype)
    x = torch.randn(tokens, hidden, generator=g).to(run.dev, dtype)
    t_dispatch: list[float] = []
    t_combine: list[float] = []
    with torch.no_grad():
        for i in range(2 + run.args.iters):
            barrier(run)
            t0 = time.perf_counter()
            expert_in, _, handle = dispatcher.dispatch(x, ids, w)
            sync(run.device)
            t1 = time.perf_counter()
            dispatcher.combine(expert_in, handle)
            sync(run.device)
            t2 = time.perf_counter()
            if i >= 2:
                t_dispatch.append(t1 - t0)
                t_combine.append(t2 - t1)
    d = reduce_scalar(run, statistics.median(t_dispatch), dist.ReduceOp.MAX)
    c = reduce_scalar(run, statistics.median(t_combine), dist.ReduceOp.MAX)
    nbytes = tokens * s.moe_top_k * hidden * x.element_size()
    return {
        "tokens/rank": tokens,
        "hidden": hidden,
        "MB/rank/way": nbytes / 1e6,
        "dispatch_ms": d * 1e3,
        "combine_ms": c * 1e3,
        "dispatch_GB/s": nbytes / d / 1e9,
        "combine_GB/s": nbytes / c / 1e9,
        "status": "ok",
    }


def section_moe(run: Run) -> dict[str, Any]:
    from moe_dispatch import AllToAllDispatcher

    s = run.sizes
    if s.moe_experts % run.world:
        raise ValueError(f"{s.moe_experts} experts do not split over {run.world} ranks")
    result: dict[str, Any] = {
        "experts": s.moe_experts,
        "top_k": s.moe_top_k,
        "ep": run.world,
        "parity": [],
        "bandwidth": [],
        "errors": [],
        "bytes_note": "tokens * top_k * hidden * element size per rank and direction, rows a "
        "rank sends to itself included (algorithmic bandwidth)",
    }
    group = dist.new_group(list(range(run.world)))
    a2a = AllToAllDispatcher(group, s.moe_experts)
    dtypes = [torch.float32] + ([torch.bfloat16] if run.device == "cuda" else [])
    for dtype in dtypes:
        out = phase(
            run, f"moe parity {dtype}", lambda d=dtype: _moe_parity(run, a2a, d, "all-to-all")
        )
        if out.ok:
            result["parity"].append(out.value)
        else:
            result["parity"].append({"dispatcher": "all-to-all", "status": "error", "pass": False})
            result["errors"] += out.errors
    # Negative control: off-by-one expert ownership must be flagged by the same check.
    ctl = phase(
        run, "moe control", lambda: _moe_parity(run, a2a, torch.float32, "all-to-all", control=True)
    )
    if ctl.ok:
        row = ctl.value
        row["detected"] = not row["pass"]
        row["pass"] = row["detected"]
        row["status"] = "ok (control)" if row["detected"] else "CONTROL NOT DETECTED"
        result["parity"].append(row)
    else:
        result["errors"] += ctl.errors
    if run.device == "cuda" and importlib.util.find_spec("deep_ep") is not None:
        from moe_dispatch import HybridEPDispatcher

        def hybrid() -> dict[str, Any]:
            return _moe_parity(
                run, HybridEPDispatcher(group, s.moe_experts), torch.bfloat16, "hybrid-ep"
            )

        out = phase(run, "moe parity hybrid-ep", hybrid)
        result["parity"].append(
            out.value if out.ok else {"dispatcher": "hybrid-ep", "status": "error", "pass": False}
        )
        result["errors"] += out.errors
    else:
        result["parity"].append(
            {"dispatcher": "hybrid-ep", "status": "skipped: deep_ep not installed or no CUDA"}
        )
    table(
        run,
        f"[moe] dispatch+combine parity vs dense float64 loop, ep={run.world}, "
        f"E={s.moe_experts} K={s.moe_top_k}",
        result["parity"],
        [
            "dispatcher",
            "dtype",
            "tokens_per_rank",
            "counts_match",
            "out_rel_err",
            "grad_x_rel_err",
            "grad_w_rel_err",
            "pass",
            "detected",
            "status",
        ],
    )
    write_section(run, "moe", result)
    for hidden in s.moe_hiddens:
        for tokens in s.moe_tokens:
            out = phase(
                run,
                f"moe bandwidth T={tokens} H={hidden}",
                lambda t=tokens, h=hidden: _moe_bandwidth(run, a2a, t, h),
            )
            if out.ok:
                result["bandwidth"].append(out.value)
            else:
                result["bandwidth"].append(
                    {
                        "tokens/rank": tokens,
                        "hidden": hidden,
                        "status": "OOM" if out.oom else "error",
                    }
                )
                result["errors"] += out.errors
            free_memory(run.device)
    table(
        run,
        f"[moe] all-to-all bandwidth, ep={run.world}, top-{s.moe_top_k}, "
        f"{'bf16' if run.device == 'cuda' else 'fp32'} (forward, no grad)",
        result["bandwidth"],
        [
            "tokens/rank",
            "hidden",
            "MB/rank/way",
            "dispatch_ms",
            "dispatch_GB/s",
            "combine_ms",
            "combine_GB/s",
            "status",
        ],
    )
    return result
