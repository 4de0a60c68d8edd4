"""MasterWeightAdamW: fp32 master weights for bf16/fp16 parameters, against float64 AdamW."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import _master_adamw_check as check
from train_engine import Engine, MasterWeightAdamW, load_checkpoint, save_checkpoint
from train_testing.reference import relative_error

HERE = Path(__file__).parent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_backend_matches_float64_adamw_on_the_masters(dtype: torch.dtype) -> None:
    got = check.run("torch", "cpu", dtype=dtype)
    assert got["master_rel_err"] < 1e-6, got
    assert got["param_ulps"] == 0.0, got  # each parameter is its master rounded to nearest
    assert got["skip_changed"] == 0.0, got
    assert got["step_count"] == 3.0, got


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed")
@pytest.mark.timeout(300)
def test_triton_kernel_in_the_interpreter_matches_float64_adamw() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, str(HERE / "_master_adamw_check.py"), "triton", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["master_rel_err"] < 1e-6, got
    # The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest, and the CUDA
    # test asserts 0): one unit of spacing at most.
    assert got["param_ulps"] <= 1.0, got
    assert got["skip_changed"] == 0.0, got
    assert got["step_count"] == 3.0, got


def test_small_updates_survive_where_bf16_adamw_rounds_them_away() -> None:
    gen = torch.Generator().manual_seed(3)
    start = (0.5 + torch.rand(4096, generator=gen)).to(torch.bfloat16)
    grad = torch.randn(4096, generator=gen).to(torch.bfloat16)
    plain = nn.Parameter(start.clone())
    ours = nn.Parameter(start.clone())
    plain_opt = torch.optim.AdamW([plain], lr=2e-5, weight_decay=0.0)
    ours_opt = MasterWeightAdamW([ours], lr=2e-5, weight_decay=0.0, backend="torch")
    for _ in range(20):
        plain.grad, ours.grad = grad.clone(), grad.clone()
        plain_opt.step()
        ours_opt.step()
    # 20 steps of ~lr each move every weight by ~4e-4: below half a bf16 spacing (~2e-3).
    assert torch.equal(plain.detach(), start), "bf16 AdamW was expected to lose these updates"
    master = ours_opt.state[ours]["master_param"].double()
    moved = (master - start.double()).abs()
    assert float(moved.min()) > 3e-4 and float(moved.max()) < 5e-4, (moved.min(), moved.max())


def test_fp32_parameters_are_their_own_master() -> None:
    gen = torch.Generator().manual_seed(5)
    ours = nn.Parameter(torch.randn(300, generator=gen))
    theirs = nn.Parameter(ours.detach().clone())
    ours_opt = MasterWeightAdamW([ours], lr=1e-2, backend="torch")
    theirs_opt = torch.optim.AdamW([theirs], lr=1e-2)
    assert "master_param" not in ours_opt.state[ours]
    for _ in range(3):
        g = torch.randn(300, generator=gen)
        ours.grad, theirs.grad = g.clone(), g.clone()
        ours_opt.step()
        theirs_opt.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)


def test_a_parameter_without_gradient_is_left_alone() -> None:
    a = nn.Parameter(torch.ones(10, dtype=torch.bfloat16))
    b = nn.Parameter(torch.ones(10, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([a, b], lr=0.1, backend="torch")
    a.grad = torch.ones(10, dtype=torch.bfloat16)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(10, dtype=torch.bfloat16))
    assert float(opt.state[b]["step"]) == 0.0 and float(opt.state[a]["step"]) == 1.0
    assert float(a.detach()[0]) < 1.0


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).to(torch.bfloat16)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(12, 16, generator=gen).to(torch.bfloat16), torch.randn(12, 8, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).float() - y) ** 2).sum()


def test_state_dict_round_trip_stays_fp32_and_continues_identically() -> None:
    model = _model(0)
    opt = MasterWeightAdamW(model.parameters(), lr=1e-2, backend="torch")
    for seed in (1, 2):
        opt.zero_grad()
        _loss(model, *_batch(seed)).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    restored_model = _model(9)  # different weights: the masters must overwrite them
    restored = MasterWeightAdamW(restored_model.parameters(), lr=5.0, backend="torch")
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["lr"] == 1e-2
    for p, q in zip(model.parameters(), restored_model.parameters(), strict=True):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert restored.state[q][key].dtype == torch.float32
            assert torch.equal(restored.state[q][key], opt.state[p][key]), key
        assert torch.equal(q.detach(), p.detach())
    for m, o in ((model, opt), (restored_model, restored)):
        o.zero_grad()
        _loss(m, *_batch(3)).backward()
        o.step()
    for p, q in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(q.detach(), p.detach())


def test_load_state_dict_rejects_a_different_optimizer() -> None:
    model = _model(0)
    opt = MasterWeightAdamW(model.parameters(), backend="torch")
    plain = torch.optim.AdamW(_model(0).parameters())
    with pytest.raises(ValueError, match=r"no entry"):
        opt.load_state_dict(plain.state_dict())  # never stepped: no state entries
    two_groups = MasterWeightAdamW(
        [{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}]
    )
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict(two_groups.state_dict())


def test_engine_clips_inside_the_update_like_float64_adamw(tmp_path: Path) -> None:
    model = _model(0)
    initial = [p.detach().clone() for p in model.parameters()]
    opt = MasterWeightAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, backend="torch")
    engine = Engine(model, opt, max_grad_norm=0.5)
    grads_seen: list[list[torch.Tensor]] = []
    scales: list[float] = []
    for seed in (1, 2):
        engine.backward(_loss(model, *_batch(seed)))
        grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        norm = torch.cat([g.double().reshape(-1) for g in grads]).norm()
        scales.append(max(1.0, (float(norm) + 1e-6) / 0.5))
        grads_seen.append(grads)
        result = engine.step()
        assert result.updated and float(result.grad_norm) > 0.5  # clipping was active
    expected = check.reference_masters(
        initial, grads_seen, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, scales=scales
    )
    for p, ref in zip(model.parameters(), expected, strict=True):
        master = opt.state[p]["master_param"].double()
        assert relative_error(master, ref) < 1e-6
    # Through the engine's checkpoint (DCP): fp32 state back, parameters from their masters.
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    other = _model(4)
    other_opt = MasterWeightAdamW(other.parameters(), lr=1e-2, backend="torch")
    load_checkpoint(tmp_path / "ckpt", model=other, optimizer=other_opt)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(other_opt.state[q]["master_param"], opt.state[p]["master_param"])
        assert other_opt.state[q]["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(q.detach(), p.detach())


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="float64"):
        MasterWeightAdamW([nn.Parameter(torch.ones(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="not contiguous"):
        MasterWeightAdamW([nn.Parameter(torch.ones(4, 6).t())])
    with pytest.raises(ValueError, match="betas"):
        MasterWeightAdamW([nn.Parameter(torch.ones(3))], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="backend"):
        MasterWeightAdamW([nn.Parameter(torch.ones(3))], backend="cuda")  # type: ignore[arg-type]
    p = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([p], backend="torch")
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="Python float"):
        opt.step()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed")
@pytest.mark.timeout(300)
def test_triton_kernel_compiles_for_sm90_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}  # really compile, no cache hit
    out = subprocess.run(
        [sys.executable, str(HERE / "_master_adamw_aot.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    if out.returncode != 0 and "ptxas" in out.stderr and "not found" in out.stderr:
        pytest.skip("triton's bundled ptxas is missing on this machine")
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_shards_update_like_the_full_tensors_and_checkpoint(rank_pool, tmp_path) -> None:
    import _master_adamw_workers as workers

    for result in rank_pool.run(2, workers.fsdp2_update, str(tmp_path), timeout_s=240):
        assert result["sharded_state"], result  # state is sharded like the parameters
        assert result["moved"] > 1e-3, result  # every tensor was updated
        assert result["mismatch"] == 0.0, result  # elementwise: bit-identical to the full update
        assert result["restored"] == 0.0 and result["restored_fp32"], result


def test_grad_scaler_drives_it_with_fp16_parameters() -> None:
    gen = torch.Generator().manual_seed(11)
    start = (0.1 * torch.randn(64, 32, generator=gen)).to(torch.float16)
    x = torch.randn(8, 32, generator=gen).to(torch.float16)
    param = nn.Parameter(start.clone())
    opt = MasterWeightAdamW([param], lr=1e-2, backend="torch")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    grads = []
    for _ in range(2):  # the second step runs after GradScaler deleted its attributes
        opt.zero_grad()
        loss = (x @ param.t()).float().square().sum()
        scaler.scale(loss).backward()
        grads.append(param.grad.detach().clone() / 1024.0)  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
    expected = check.reference_masters(
        [start],
        [[g] for g in grads],
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        scales=[1.0, 1.0],
    )[0]
    master = opt.state[param]["master_param"].double()
    assert relative_error(master, expected) < 1e-6
    assert float(opt.state[param]["step"]) == 2.0
