"""Section ``vocab``: vocab-parallel's log-probs on sharded DTensors against float64, and timing."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train_testing.bench import free_memory

from .harness import (
    IGNORE,
    Run,
    abs_err,
    all_gather_ints,
    peak_gib_max,
    phase,
    reduce_scalar,
    rel_err,
    reset_peak,
    table,
    timed,
    write_section,
)

# vocab: fp32 arithmetic on bf16 inputs. Values from given logits are exact up to fp32 sums;
# gradients are stored in bf16 (relative rounding 2^-8). The fused form rounds its logits to
# bf16 inside the matmul, hence the looser value bound.
VP_VALUE_TOL = 2e-4
VP_LINEAR_VALUE_TOL = 5e-2
VP_GRAD_TOL = 1e-2
VP_LINEAR_GRAD_TOL = 2e-2


def _vp_inputs(run: Run) -> dict[str, Tensor]:
    """Same tensors on every rank: generated on rank 0's stream of a fixed seed, then broadcast."""
    s = run.sizes
    t, v, h = s.vocab_tokens, s.vocab_size, s.vocab_hidden
    dev = run.dev
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if run.device == "cuda" else torch.float32
    out = {
        "logits": (torch.randn(t, v, generator=g, device=dev) * 2.0).to(dtype),
        "hidden": torch.randn(t, h, generator=g, device=dev).to(dtype),
        # Logits of std 1: bf16 rounding of the fused form's logits stays well inside its bound.
        "weight": (torch.randn(v, h, generator=g, device=dev) / math.sqrt(h)).to(dtype),
        "labels": torch.randint(0, v, (t,), generator=g, device=dev),
        "upstream": torch.randn(t, generator=g, device=dev),
    }
    ignored = torch.rand(t, generator=g, device=dev) < 0.05
    out["labels"] = out["labels"].masked_fill(ignored, IGNORE)
    for x in out.values():
        dist.broadcast(x, src=0)
    return out


def _ref_log_probs(logits64: Tensor, labels: Tensor) -> Tensor:
    """float64 dense reference: log_softmax then gather; 0 where the label is ignored."""
    valid = labels != IGNORE
    lp = torch.log_softmax(logits64, dim=-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(valid, lp, torch.zeros_like(lp))


def _vp_parity(run: Run, mesh: DeviceMesh, x: dict[str, Tensor]) -> list[dict[str, Any]]:
    from torch.distributed.tensor import Shard, distribute_tensor

    import vocab_parallel as vp

    rows = []
    labels, up = x["labels"], x["upstream"]
    # Logits form.
    dt = distribute_tensor(x["logits"], mesh, [Shard(1)]).requires_grad_()
    lp = vp.token_log_probs(dt, labels)
    (lp * up).sum().backward()
    got_grad = dt.grad.full_tensor()
    ref_in = x["logits"].double().requires_grad_()
    ref = _ref_log_probs(ref_in, labels)
    (ref * up.double()).sum().backward()
    v_err, g_err = abs_err(lp, ref), rel_err(got_grad, ref_in.grad)
    rows.append(
        {
            "function": "token_log_probs",
            "local_shape": list(dt.to_local().shape),
            "value_abs_err": v_err,
            "grad_rel_err": g_err,
            "pass": v_err < VP_VALUE_TOL and g_err < VP_GRAD_TOL,
        }
    )
    # Negative control: each rank normalising over its own shard only must be flagged.
    local = dt.to_local().detach()
    offset = sum(all_gather_ints(run, local.shape[-1])[: run.rank])
    in_shard = (labels >= offset) & (labels < offset + local.shape[-1])
    local_labels = torch.where(in_shard, labels - offset, torch.full_like(labels, IGNORE))
    wrong = vp.token_log_probs(local, local_labels)
    expect = torch.where(in_shard, ref.detach(), torch.zeros_like(ref))
    c_err = reduce_scalar(run, abs_err(wrong, expect), dist.ReduceOp.MAX)
    rows.append(
        {
            "function": "control: shard-local softmax",
            "local_shape": list(local.shape),
            "value_abs_err": c_err,
            "detected": c_err >= VP_VALUE_TOL,
            "pass": c_err >= VP_VALUE_TOL,
            "status": "ok (control)" if c_err >= VP_VALUE_TOL else "CONTROL NOT DETECTED",
        }
    )
    del dt, lp, got_grad, ref_in, ref, local, wrong
    free_memory(run.device)
    # Fused linear form: weight sharded over V (a ColwiseParallel lm_head).
    w = distribute_tensor(x["weight"], mesh, [Shard(0)]).requires_grad_()
    hidden = x["hidden"].clone().requires_grad_()
    lp = vp.linear_token_log_probs(hidden, w, labels)
    (lp * up).sum().backward()
    w_grad = w.grad.full_tensor()
    h64 = x["hidden"].double().requires_grad_()
    w64 = x["weight"].double().requires_grad_()
    ref = _ref_log_probs(h64 @ w64.T, labels)
    (ref * up.double()).sum().backward()
    v_err = abs_err(lp, ref)
    gw, gh = rel_err(w_grad, w64.grad), rel_err(hidden.grad, h64.grad)
    # Every rank must hold the same (full) hidden gradient.
    first = hidden.grad.clone()
    dist.broadcast(first, src=0)
    h_spread = reduce_scalar(run, rel_err(hidden.grad, first), dist.ReduceOp.MAX)
    rows.append(
        {
            "function": "linear_token_log_probs",
            "local_shape": list(w.to_local().shape),
            "value_abs_err": v_err,
            "grad_rel_err": max(gw, gh),
            "weight_grad_rel_err": gw,
            "hidden_grad_rel_err": gh,
            "hidden_grad_rank_spread": h_spread,
            "pass": v_err < VP_LINEAR_VALUE_TOL
            and max(gw, gh) < VP_LINEAR_GRAD_TOL
            and h_spread < 1e-6,
        }
    )
    return rows


def _vp_timing(run: Run, mesh: DeviceMesh, x: dict[str, Tensor]) -> list[dict[str, Any]]:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import vocab_parallel as vp

    labels, up = x["labels"], x["upstream"]
    safe = labels.clamp(min=0)[:, None]
    valid = labels != IGNORE
    dt = distribute_tensor(x["logits"], mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(x["weight"], mesh, [Shard(0)]).requires_grad_()
    hidden = x["hidden"].clone().requires_grad_()
    shape = torch.Size((hidden.shape[0], w.shape[0]))  # [T, V]; V may be uneven over ranks

    def naive(logits: Tensor) -> Tensor:
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe)[:, 0]
        return torch.where(valid, lp, torch.zeros_like(lp))

    def ours_logits() -> None:
        (vp.token_log_probs(dt, labels) * up).sum().backward()
        dt.grad = None

    def gather_logits() -> None:
        (naive(dt.full_tensor()) * up).sum().backward()
        dt.grad = None

    def ours_linear() -> None:
        (vp.linear_token_log_probs(hidden, w, labels) * up).sum().backward()
        w.grad, hidden.grad = None, None

    def gather_linear() -> None:
        local = hidden @ w.to_local().T  # [T, V/W]
        full = DTensor.from_local(
            local, mesh, [Shard(1)], run_check=False, shape=shape, stride=(shape[1], 1)
        ).full_tensor()
        (naive(full) * up).sum().backward()
        assert hidden.grad is not None
        dist.all_reduce(hidden.grad)  # what the fused form's backward does for the hidden grad
        w.grad, hidden.grad = None, None

    rows = []
    pairs = [
        ("token_log_probs (sharded)", ours_logits, "logits"),
        ("full_tensor + log_softmax", gather_logits, "logits"),
        ("linear_token_log_probs (sharded W)", ours_linear, "linear"),
        ("matmul + full_tensor + log_softmax", gather_linear, "linear"),
    ]
    for name, fn, form in pairs:
        out = phase(run, f"vocab timing {name}", lambda fn=fn: _time_with_memory(run, fn))
        row = {"variant": name, "form": form}
        if out.ok:
            row.update(out.value)
        else:
            row.update(status="OOM" if out.oom else "error", error=out.errors)
        rows.append(row)
    for form in ("logits", "linear"):
        ours, base = [r for r in rows if r["form"] == form]
        if "ms" in ours and "ms" in base:
            ours["speedup_vs_gather"] = base["ms"] / ours["ms"]
    return rows


def _time_with_memory(run: Run, fn: Callable[[], None]) -> dict[str, Any]:
    base = reset_peak(run)
    seconds = timed(run, fn, warmup=2, iters=run.args.iters)
    peak = peak_gib_max(run)
    return {
        "ms": seconds * 1e3,
        "peak_extra_gib": None if peak is None else peak - base,
        "status": "ok",
    }


def section_vocab(run: Run) -> dict[str, Any]:
    s = run.sizes
    result: dict[str, Any] = {
        "tokens": s.vocab_tokens,
        "vocab": s.vocab_size,
        "hidden": s.vocab_hidden,
        "dtype": "bfloat16" if run.device == "cuda" else "float32",
        "tp": run.world,
        "tolerances": {
            "value_abs": VP_VALUE_TOL,
            "grad_rel": VP_GRAD_TOL,
            "linear_value_abs": VP_LINEAR_VALUE_TOL,
            "linear_grad_rel": VP_LINEAR_GRAD_TOL,
        },
        "errors": [],
    }
    mesh = init_device_mesh(run.device, (run.world,), mesh_dim_names=("tp",))
    inputs = phase(run, "vocab inputs", lambda: _vp_inputs(run))
    if not inputs.ok:
        result["errors"] += inputs.errors
        return result
    x = inputs.value
    par = phase(run, "vocab parity", lambda: _vp_parity(run, mesh, x))
    result["parity"] = par.value if par.ok else [{"status": "error", "error": par.errors}]
    if not par.ok:
        result["errors"] += par.errors
    free_memory(run.device)
    table(
        run,
        f"[vocab] parity vs float64 dense, tp={run.world}, T={s.vocab_tokens} V={s.vocab_size}",
        result["parity"],
        ["function", "local_shape", "value_abs_err", "grad_rel_err", "pass", "detected", "status"],
    )
    write_section(run, "vocab", result)
    tim = phase(run, "vocab timing", lambda: _vp_timing(run, mesh, x))
    result["timing"] = tim.value if tim.ok else [{"status": "error", "error": tim.errors}]
    if not tim.ok:
        result["errors"] += tim.errors
    table(
        run,
        f"[vocab] forward+backward, tp={run.world} ({result['dtype']}, H={s.vocab_hidden})",
        result["timing"],
        ["variant", "ms", "speedup_vs_gather", "peak_extra_gib", "status"],
    )
    return result
