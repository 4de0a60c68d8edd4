"""MasterWeightAdamW on FSDP2's bf16 DTensor shards, run on spawned gloo ranks (keep imports light)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from train_engine import (
    FSDP2Config,
    MasterWeightAdamW,
    apply_data_parallel,
    load_checkpoint,
    save_checkpoint,
)

SETTINGS: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _sharded_model(seed: int, world: int) -> nn.Module:
    torch.manual_seed(seed)
    # 33 rows: the shards are uneven (17 and 16 rows), FSDP2 pads the last one.
    model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 8)).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    return apply_data_parallel(model, mesh=mesh, config=FSDP2Config())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def fsdp2_update(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Two clipped updates of the shards against the same optimizer on the gathered tensors.

    AdamW is elementwise, so each rank's shard must come out bit-identical to the matching
    slice of a single-process update of the full tensors with the full gradients. Then a DCP
    checkpoint round trip into a model built from other weights.
    """
    model = _sharded_model(0, world)
    params = list(model.parameters())
    opt = MasterWeightAdamW(params, **SETTINGS, backend="torch")
    reference = [nn.Parameter(_full(p)) for p in params]
    initial = [_full(p).float() for p in params]
    ref_opt = MasterWeightAdamW(reference, **SETTINGS, backend="torch")
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    sharded_state = all(isinstance(opt.state[p]["master_param"], DTensor) for p in params)
    for _ in range(2):
        x = torch.randn(6, 16, generator=gen).to(torch.bfloat16)
        model(x).float().square().sum().backward()
        for ref, p in zip(reference, params, strict=True):
            ref.grad = _full(p.grad)  # type: ignore[arg-type]
        for o in (opt, ref_opt):
            o.grad_scale = torch.tensor(3.0)  # the Engine's clipping divisor
            o.step()
            o.grad_scale = None
            o.zero_grad()
    mismatch = 0.0
    for ref, p in zip(reference, params, strict=True):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            got, want = _full(opt.state[p][key]), ref_opt.state[ref][key]
            mismatch = max(mismatch, float((got - want).abs().max()))
        mismatch = max(mismatch, float((_full(p).float() - ref.detach().float()).abs().max()))
    moved = min(
        float((_full(opt.state[p]["master_param"]) - start).abs().max())
        for p, start in zip(params, initial, strict=True)
    )
    save_checkpoint(Path(directory) / "ckpt", model=model, optimizer=opt)
    other = _sharded_model(5, world)
    other_opt = MasterWeightAdamW(other.parameters(), **SETTINGS, backend="torch")
    load_checkpoint(Path(directory) / "ckpt", model=other, optimizer=other_opt)
    restored = 0.0
    restored_fp32 = True
    for p, q in zip(params, other.parameters(), strict=True):
        for key in ("master_param", "exp_avg", "exp_avg_sq", "step"):
            got, want = other_opt.state[q][key], opt.state[p][key]
            restored_fp32 &= got.dtype == torch.float32
            restored = max(restored, float((_full(got) - _full(want)).abs().max()))
        restored = max(restored, float((_full(q).float() - _full(p).float()).abs().max()))
    dist.barrier()
    return {
        "sharded_state": sharded_state,
        "mismatch": mismatch,
        "moved": moved,
        "restored": restored,
        "restored_fp32": restored_fp32,
    }
