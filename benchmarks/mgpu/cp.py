"""Section ``cp``: cp-sharder's loss and gradient parity against cp=1, and throughput against S."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train_testing.bench import GIB, flops_per_token, free_memory

from .harness import (
    IGNORE,
    Run,
    build_llama,
    emit,
    peak_gib_max,
    phase,
    rel_err,
    reset_peak,
    strict_fp32,
    table,
    timed,
    write_section,
)

# Parity tolerances: fp32 end to end (TF32 off), as the package's CUDA tests.
CP_LOSS_TOL = 1e-4
CP_GRAD_TOL = 1e-3
# The bf16-autocast fallback of the ring case (cp and reference both autocast): rounding only.
CP_BF16_LOSS_TOL = 5e-3
CP_BF16_GRAD_TOL = 5e-2


def _cp_batch(run: Run, kind: str, bsz: int, seq: int, vocab: int) -> dict[str, Tensor]:
    """Pre-shifted labels; ``portable`` left-pads row 1 by 3 tokens (a key-padding mask, which
    only the portable backend serves), ``ring`` is a plain causal batch."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, vocab, (bsz, seq), generator=g)
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    batch = {"input_ids": ids, "labels": labels}
    if kind == "portable":
        mask = torch.ones(bsz, seq, dtype=torch.long)
        mask[min(1, bsz - 1), :3] = 0
        labels[mask == 0] = IGNORE
        labels[:, :-1][mask[:, 1:] == 0] = IGNORE
        batch["attention_mask"] = mask
    return {k: v.to(run.dev) for k, v in batch.items()}


def _loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


def _grads(model: torch.nn.Module) -> dict[str, Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def _autocast(run: Run, on: bool) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast (the fallback of a ring parity case whose fp32 run failed), or nothing."""
    if not on:
        return contextlib.nullcontext()
    return torch.autocast(run.device, dtype=torch.bfloat16)


def _cp1_reference(
    run: Run, model: Any, batch: dict[str, Tensor], *, bf16: bool = False
) -> tuple[float, dict[str, Tensor]]:
    """cp=1: the unmodified model on the whole batch (computed redundantly by every rank)."""
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    with _autocast(run, bf16):
        logits = model(**inputs).logits
    count = int((batch["labels"] != IGNORE).sum())
    loss = _loss_sum(logits, batch["labels"]) / count
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _cp_parity_step(
    run: Run,
    model: Any,
    mesh: DeviceMesh,
    batch: dict[str, Tensor],
    ref: tuple[float, dict[str, Tensor]],
    *,
    use_ctx: bool = True,
    bf16: bool = False,
) -> dict[str, Any]:
    from cp_sharder import ContextParallelSharder

    model.zero_grad(set_to_none=True)
    sharder = ContextParallelSharder(model, mesh, padding_token_id=0)
    train_ctx, local = sharder.shard(batch)
    labels = local.pop("labels")
    with train_ctx() if use_ctx else contextlib.nullcontext(), _autocast(run, bf16):
        logits = model(**local).logits
    count = sharder.num_label_tokens(device=run.dev)
    loss = _loss_sum(logits, labels) / count
    loss.backward()
    del logits
    group = mesh.get_group()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    ref_loss, ref_grads = ref
    loss_tol, grad_tol = (
        (CP_BF16_LOSS_TOL, CP_BF16_GRAD_TOL) if bf16 else (CP_LOSS_TOL, CP_GRAD_TOL)
    )
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)  # local loss / global count: summed grads = no-CP grads
        err = rel_err(g, ref_grads[name])
        if err > worst:
            worst, worst_name = err, name
    model.zero_grad(set_to_none=True)
    loss_err = abs(float(total) - ref_loss) / abs(ref_loss)
    return {
        "backend": sharder.layout.backend.value,
        "loss": float(total),
        "ref_loss": ref_loss,
        "loss_rel_err": loss_err,
        "grad_rel_err": worst,
        "worst_param": worst_name,
        "pass": loss_err < loss_tol and worst < grad_tol,
    }


def _ring_bf16_fallback(
    run: Run, model: Any, mesh: DeviceMesh, batch: dict[str, Tensor]
) -> dict[str, Any]:
    """The ring case again under bf16 autocast (flash kernels), when its fp32 run failed (e.g. no
    fp32 kernel for grouped-query attention in torch's ring): CP and reference both autocast."""
    c = mesh.size()
    ref = phase(run, "cp reference ring bf16", lambda: _cp1_reference(run, model, batch, bf16=True))
    if not ref.ok:
        return {"case": "ring (bf16 autocast)", "cp": c, "status": "error", "error": ref.errors}
    out = phase(
        run,
        f"cp parity ring bf16 cp={c}",
        lambda r=ref.value: _cp_parity_step(run, model, mesh, batch, r, bf16=True),
    )
    row = {"case": "ring (bf16 autocast)", "cp": c, **(out.value or {})}
    if not out.ok:
        row.update(status="error", error=out.errors, **{"pass": False})
    else:
        if row["backend"] == "torch_ring":
            row["status"] = "ok"
        else:
            row.update(status=f"wrong backend {row['backend']}", **{"pass": False})
        row["tolerances"] = {"loss_rel": CP_BF16_LOSS_TOL, "grad_rel": CP_BF16_GRAD_TOL}
    return row


def _cp_meshes(run: Run, sizes: list[int]) -> dict[int, DeviceMesh]:
    """A ("dp", "cp") mesh per cp size; cp < W runs W/cp replicas of the same work side by side."""
    out = {}
    for c in sizes:
        if run.world % c:
            raise ValueError(f"--cp-sizes entry {c} does not divide the world size {run.world}")
        mesh = init_device_mesh(run.device, (run.world // c, c), mesh_dim_names=("dp", "cp"))
        out[c] = mesh["cp"]
    return out


def _model_flops_per_token(model: Any, seq: int) -> float:
    """6 * non-embedding parameters + causal attention (6 * layers * hidden * S), per token."""
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return flops_per_token(n, model.config, seq)


def section_cp(run: Run) -> dict[str, Any]:

    s = run.sizes
    args = run.args
    cp_sizes = args.cp_sizes or [run.world]
    seq_lens = args.seq_lens or list(s.seq_lens)
    meshes = _cp_meshes(run, cp_sizes)
    vocab = s.cp_model["vocab_size"]
    backends = ["portable"] + (["ring"] if run.device == "cuda" else [])
    result: dict[str, Any] = {
        "model": s.cp_model,
        "cp_sizes": cp_sizes,
        "parity": [],
        "throughput": [],
        "longest_fit": {},
        "errors": [],
        "tolerances": {"loss_rel": CP_LOSS_TOL, "grad_rel": CP_GRAD_TOL},
    }
    if run.device != "cuda":
        result["parity"].append(
            {"backend": "ring", "status": "skipped: torch's ring attention runs on CUDA only"}
        )

    built = phase(
        run,
        "cp build",
        lambda: build_llama(run, s.cp_model, max(max(seq_lens), s.cp_parity_seq), torch.float32),
    )
    if not built.ok:
        result["errors"] += built.errors
        return result
    model = built.value
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    result["params"] = n_params

    # Parity: cp=c vs cp=1, fp32, for each backend; one control run without train_ctx.
    parity_cps = [c for c in cp_sizes if c > 1]
    for kind in backends:
        batch = _cp_batch(run, kind, s.cp_parity_batch, s.cp_parity_seq, vocab)
        with strict_fp32():
            ref = phase(run, f"cp reference {kind}", lambda b=batch: _cp1_reference(run, model, b))
        if not ref.ok:
            result["errors"] += ref.errors
            continue
        for c in parity_cps:
            with strict_fp32():
                out = phase(
                    run,
                    f"cp parity {kind} cp={c}",
                    lambda b=batch, c=c, r=ref.value: _cp_parity_step(run, model, meshes[c], b, r),
                )
            row = {"case": kind, "cp": c, **(out.value or {})}
            if not out.ok:
                row.update(status="error", error=out.errors, **{"pass": False})
            elif row["backend"] != {"portable": "portable", "ring": "torch_ring"}[kind]:
                row.update(status=f"wrong backend {row['backend']}", **{"pass": False})
            else:
                row["status"] = "ok"
            result["parity"].append(row)
            if kind == "ring" and not out.ok:
                result["parity"].append(_ring_bf16_fallback(run, model, meshes[c], batch))
            if kind == "portable" and c == parity_cps[-1]:
                # Negative control: the same sharded batch without train_ctx attends only to local
                # keys; the check must flag it, or the tolerances are too loose to mean anything.
                with strict_fp32():
                    ctl = phase(
                        run,
                        "cp control",
                        lambda b=batch, c=c, r=ref.value: _cp_parity_step(
                            run, model, meshes[c], b, r, use_ctx=False
                        ),
                    )
                ctl_row = {"case": "control: no train_ctx", "cp": c, **(ctl.value or {})}
                if ctl.ok:
                    ctl_row["detected"] = not ctl_row.pop("pass")
                    ctl_row["status"] = "ok" if ctl_row["detected"] else "CONTROL NOT DETECTED"
                    ctl_row["pass"] = ctl_row["detected"]
                else:
                    ctl_row.update(status="error", error=ctl.errors, **{"pass": False})
                result["parity"].append(ctl_row)
        del ref
        free_memory(run.device)
    table(
        run,
        f"[cp] parity vs cp=1 (fp32, batch {s.cp_parity_batch} x {s.cp_parity_seq}, "
        f"{n_params / 1e6:.1f}M params)",
        result["parity"],
        [
            "case",
            "cp",
            "backend",
            "loss_rel_err",
            "grad_rel_err",
            "worst_param",
            "pass",
            "detected",
            "status",
        ],
    )
    write_section(run, "cp", result)

    # Throughput: bf16, batch 1, plain causal batch (torch's ring on CUDA, portable on CPU).
    model.to(torch.bfloat16 if run.device == "cuda" else torch.float32)
    model.zero_grad(set_to_none=True)
    free_memory(run.device)
    capacity = (
        torch.cuda.get_device_properties(run.dev).total_memory / GIB
        if run.device == "cuda"
        else None
    )
    for c in cp_sizes:
        backend = args.cp_throughput_backend
        longest, broke = _cp_sweep(run, model, meshes[c], seq_lens, backend, capacity, result)
        if longest is None and broke == "error" and backend == "auto" and c > 1:
            # torch's ring failed outright (e.g. an API change in this torch): still measure CP,
            # with the portable backend, instead of leaving the sweep empty.
            emit(run, f"[cp] cp={c}: the auto backend failed; sweeping the portable backend")
            longest, broke = _cp_sweep(
                run, model, meshes[c], seq_lens, "portable", capacity, result
            )
        result["longest_fit"][str(c)] = longest
    table(
        run,
        f"[cp] forward+backward throughput, batch 1 ({run.device}, "
        f"{'bf16' if run.device == 'cuda' else 'fp32'})",
        result["throughput"],
        [
            "cp",
            "seq",
            "backend",
            "ms",
            "tokens/s",
            "tokens/s/gpu",
            "TFLOP/s/gpu",
            "peak_gib",
            "status",
        ],
    )
    emit(run, f"[cp] longest sequence that fits per cp: {result['longest_fit']}")
    return result


def _cp_sweep(
    run: Run,
    model: Any,
    mesh: DeviceMesh,
    seq_lens: list[int],
    backend: str,
    capacity: float | None,
    result: dict[str, Any],
) -> tuple[int | None, str]:
    """Throughput at growing S on one cp mesh until a failure or a predicted out-of-memory.

    Returns:
        (longest S that ran or None, why the sweep ended: "done", "oom", "predicted", "error").
    """
    from cp_sharder import ContextParallelSharder

    c = mesh.size()
    vocab = run.sizes.cp_model["vocab_size"]
    last: tuple[int, float] | None = None
    longest = None
    for seq in seq_lens:
        if seq % (2 * c):
            result["throughput"].append({"cp": c, "seq": seq, "status": "skip: not % 2*cp"})
            continue
        if last is not None and capacity is not None:
            prev_seq, prev_peak = last
            growth = seq / prev_seq
            if backend == "portable" and c > 1:
                growth = growth**2  # the portable backend's [S/cp, S] mask and scores
            predicted = prev_peak * growth
            if predicted > 0.95 * capacity:
                result["throughput"].append(
                    {
                        "cp": c,
                        "seq": seq,
                        "status": f"skip: predicted {predicted:.0f} GiB > "
                        f"0.95 x {capacity:.0f} GiB",
                    }
                )
                return longest, "predicted"
        out = phase(
            run,
            f"cp throughput cp={c} S={seq}",
            lambda seq=seq: _cp_throughput(
                run, model, mesh, seq, vocab, backend, ContextParallelSharder
            ),
        )
        model.zero_grad(set_to_none=True)
        free_memory(run.device)
        if not out.ok:
            status = "OOM" if out.oom else "error"
            result["throughput"].append(
                {"cp": c, "seq": seq, "status": status, "error": out.errors}
            )
            if not out.oom:
                result["errors"] += out.errors
            write_section(run, "cp", result)
            return longest, status.lower()
        row = out.value
        result["throughput"].append(row)
        longest = seq
        if row["peak_gib"] is not None:
            last = (seq, row["peak_gib"])
        write_section(run, "cp", result)
    return longest, "done"


def _cp_throughput(
    run: Run,
    model: Any,
    mesh: DeviceMesh,
    seq: int,
    vocab: int,
    backend: str,
    sharder_cls: Any,
) -> dict[str, Any]:
    c = mesh.size()
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(1, vocab, (1, seq), generator=g)
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    batch = {"input_ids": ids.to(run.dev), "labels": labels.to(run.dev)}
    if backend == "portable":
        # A masked first key makes the batch not plain causal: the sharder then keeps the
        # portable backend on CUDA too.
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        batch["attention_mask"] = mask.to(run.dev)
        batch["labels"][0, 0] = IGNORE
    sharder = sharder_cls(model, mesh, padding_token_id=0)
    used = {"backend": ""}

    def step() -> None:
        train_ctx, local = sharder.shard(batch)
        used["backend"] = sharder.layout.backend.value
        lab = local.pop("labels")
        with train_ctx():
            logits = model(**local).logits
        loss = _loss_sum(logits, lab) / sharder.num_label_tokens(device=run.dev)
        del logits
        loss.backward()
        model.zero_grad(set_to_none=True)

    base = reset_peak(run)
    seconds = timed(run, step, warmup=1, iters=run.args.steps)
    peak = peak_gib_max(run)
    tokens_s = seq / seconds
    flops = _model_flops_per_token(model, seq) * seq
    return {
        "cp": c,
        "seq": seq,
        "backend": used["backend"],
        "ms": seconds * 1e3,
        "tokens/s": tokens_s,
        "tokens/s/gpu": tokens_s / c,
        "TFLOP/s/gpu": flops / seconds / c / 1e12,
        "peak_gib": peak,
        "base_gib": base,
        "status": "ok",
    }
