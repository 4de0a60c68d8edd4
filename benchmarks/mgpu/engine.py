"""Section ``engine``: train-engine's FSDP2 SFT step, tokens/s per GPU at dp=W against one GPU."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train_testing.bench import flops_per_token, free_memory

from .harness import (
    Run,
    build_llama,
    peak_gib_max,
    phase,
    reduce_scalar,
    reset_peak,
    table,
    timed,
)


def _engine_step_rate(run: Run, mesh: DeviceMesh) -> dict[str, Any]:
    from train_engine import Engine, FSDP2Config, apply_data_parallel, param_groups

    s = run.sizes
    model = build_llama(run, s.engine_model, s.engine_seq, torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    cuda = run.device == "cuda"
    model = apply_data_parallel(
        model,
        mesh=mesh,
        config=FSDP2Config(
            param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32
        ),
    )
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-5, fused=cuda)
    engine = Engine(model, opt, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(1000 + run.rank)
    vocab = s.engine_model["vocab_size"]
    data = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (s.engine_batch, s.engine_seq), generator=g).to(run.dev)
        data.append({"input_ids": ids, "labels": ids.clone()})
    state = {"i": 0, "loss": 0.0}

    def step() -> None:
        batch = data[state["i"] % 2]
        state["i"] += 1
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

    base = reset_peak(run)
    seconds = timed(run, step, warmup=2, iters=run.args.steps)
    peak = peak_gib_max(run)
    with torch.no_grad():
        final = float(model(**data[0]).loss)
    tokens = s.engine_batch * s.engine_seq
    flops = flops_per_token(n_params, model.config, s.engine_seq)
    return {
        "dp": mesh.size(),
        "ms/step": seconds * 1e3,
        "tokens/s/gpu": tokens / seconds,
        "TFLOP/s/gpu": tokens / seconds * flops / 1e12,
        "peak_gib": peak,
        "base_gib": base,
        "final_loss": final,
        "finite": math.isfinite(final),
        "params": n_params,
        "status": "ok",
    }


def section_engine(run: Run) -> dict[str, Any]:
    s = run.sizes
    result: dict[str, Any] = {
        "model": s.engine_model,
        "batch_per_gpu": [s.engine_batch, s.engine_seq],
        "rows": [],
        "errors": [],
    }
    single: float | None = run.args.single_gpu_tokens_per_s
    if single is None:
        # Every rank runs the one-GPU step on its own 1-rank mesh at the same time: the
        # same number as rank 0 alone, in the time of one run.
        solo_mesh = init_device_mesh(run.device, (run.world, 1), mesh_dim_names=("rep", "dp"))
        out = phase(run, "engine dp=1", lambda: _engine_step_rate(run, solo_mesh["dp"]))
        if out.ok:
            row = out.value
            # Each rank measured its own GPU; report the slowest.
            row["tokens/s/gpu"] = reduce_scalar(run, row["tokens/s/gpu"], dist.ReduceOp.MIN)
            row["setup"] = "one GPU (every rank alone)"
            result["rows"].append(row)
            single = row["tokens/s/gpu"]
        else:
            result["rows"].append({"dp": 1, "status": "OOM" if out.oom else "error"})
            result["errors"] += out.errors
    else:
        result["rows"].append(
            {"dp": 1, "tokens/s/gpu": single, "setup": "--single-gpu-tokens-per-s", "status": "ok"}
        )
    free_memory(run.device)
    mesh = init_device_mesh(run.device, (run.world,), mesh_dim_names=("dp",))
    out = phase(run, f"engine dp={run.world}", lambda: _engine_step_rate(run, mesh))
    if out.ok:
        row = out.value
        row["setup"] = f"FSDP2 over {run.world} ranks"
        if single:
            row["efficiency"] = row["tokens/s/gpu"] / single
        result["rows"].append(row)
    else:
        result["rows"].append({"dp": run.world, "status": "OOM" if out.oom else "error"})
        result["errors"] += out.errors
    table(
        run,
        f"[engine] SFT step (Engine + FSDP2, "
        f"{'bf16 params / fp32 reduce' if run.device == 'cuda' else 'fp32'}), batch "
        f"{s.engine_batch} x {s.engine_seq} per GPU",
        result["rows"],
        [
            "setup",
            "dp",
            "ms/step",
            "tokens/s/gpu",
            "efficiency",
            "TFLOP/s/gpu",
            "peak_gib",
            "final_loss",
            "status",
        ],
    )
    return result
