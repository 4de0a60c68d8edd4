"""CUDA/NCCL paths (skipped without GPUs; run on the GPU machine)."""

from __future__ import annotations

import math

import pytest
import torch

import _engine_workers as w
from _engine_models import reference_sgd_run
from train_engine import global_grad_norm
from train_testing import requires_cuda, run_on_ranks


@requires_cuda(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_grad_norm_matches_float64_cpu_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in [(1000, 37), (5,), (3, 3, 3), (70000,)]:
        p = torch.zeros(shape, device="cuda", dtype=dtype, requires_grad=True)
        p.grad = torch.randn(shape, generator=g).to("cuda", dtype)
        params.append(p)
    flat = torch.cat([p.grad.double().cpu().reshape(-1) for p in params])
    for norm_type in (2.0, math.inf):
        got = global_grad_norm(params, norm_type)
        assert got.device.type == "cuda"
        expected = flat.abs().max() if math.isinf(norm_type) else flat.norm()
        assert float(got) == pytest.approx(float(expected), rel=1e-6)


@requires_cuda(2)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_nccl_split_invariance(kind: str) -> None:
    reference = reference_sgd_run(
        steps=3, n_seq=w.N_SEQ, lr=0.1, momentum=0.9, max_grad_norm=0.5, data_seed=21
    )
    results = run_on_ranks(
        2, w.invariance, kind, 2, 3, 21, device="cuda", backend="nccl", timeout_s=300
    )
    for r in results:
        err = max(float((r["params"][k] - reference[k]).abs().max()) for k in reference)
        assert err < 1e-5, f"{kind} on NCCL: max |param - ref| = {err:.3e}"


@requires_cuda(2)
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("kind", "bucket_view"), [("ddp", True), ("fsdp2", False)])
def test_nccl_clip_parity(kind: str, bucket_view: bool) -> None:
    results = run_on_ranks(
        2, w.clip_parity, kind, 2.0, bucket_view, device="cuda", backend="nccl", timeout_s=300
    )
    for r in results:
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5)
        err = max(float((r["params"][k] - r["ref_params"][k]).abs().max()) for k in r["params"])
        assert err < 1e-5, err


@requires_cuda(4)
@pytest.mark.timeout(600)
def test_nccl_clip_parity_fsdp2_tp() -> None:
    results = run_on_ranks(
        4, w.clip_parity, "fsdp2_tp", 2.0, device="cuda", backend="nccl", timeout_s=300
    )
    for r in results:
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5)


@requires_cuda(1)
@pytest.mark.timeout(600)
def test_fsdp2_bf16_mixed_precision_step_on_one_gpu() -> None:
    """FSDP2 with bf16 params / fp32 reduce on a 1-rank NCCL group: the update tracks an fp32
    single-GPU reference within bf16 tolerance."""
    results = run_on_ranks(1, w.bf16_fsdp2_step, backend="nccl", timeout_s=300)
    assert results[0] < 2e-2, results[0]


@requires_cuda(1)
def test_fused_update_on_cuda_never_syncs_and_skips_exactly() -> None:
    """With fused AdamW the boundary step() makes no host synchronisation (CUDA's sync debug
    mode turns any into an error), and a non-finite window leaves the run bitwise identical
    to one without that window."""
    from _engine_models import global_batch, make_model, token_loss_mean
    from train_engine import Engine

    def run(windows: list[tuple[int, float]]) -> tuple[Engine, list]:
        torch.manual_seed(0)
        model = make_model().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        engine = Engine(model, opt, sched, max_grad_norm=0.3)
        results = []
        for seed, factor in windows:
            ids, labels = global_batch(seed, 4)
            loss = token_loss_mean(engine(ids.cuda()), labels.cuda()) * factor
            engine.backward(loss)
            torch.cuda.set_sync_debug_mode("error")
            try:
                results.append(engine.step())
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return engine, results

    clean, _ = run([(1, 1.0), (2, 1.0), (3, 1.0)])
    engine, results = run([(1, 1.0), (9, math.inf), (2, 1.0), (3, 1.0)])
    assert [r.skipped for r in results] == [False, True, False, False]
    assert engine.optimizer_steps == 3 and engine.skipped_steps == 1
    for a, b in zip(engine.module.parameters(), clean.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert engine.lr_scheduler.state_dict() == clean.lr_scheduler.state_dict()


@requires_cuda(1)
def test_cuda_token_counts_are_validated_without_a_sync() -> None:
    """A token count on the GPU is checked on the device: backward() and step() stay free of
    host synchronisation (sync debug mode), a valid count gives the update of the same count
    passed as a Python int, and a nan count or one that changes within the window skips the
    update (the window's gradient is NaN) instead of scaling it wrongly."""
    from _engine_models import IGNORE, global_batch, make_model, token_loss_sum
    from train_engine import Engine

    def run(windows: list[tuple[object, object]]) -> tuple[Engine, list]:
        torch.manual_seed(0)
        model = make_model().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        engine = Engine(model, opt, max_grad_norm=0.3, gradient_accumulation_steps=2)
        ids, labels = global_batch(5, 4)
        results = []
        for counts in windows:
            for part, count in zip((slice(0, 2), slice(2, 4)), counts, strict=True):
                loss = token_loss_sum(engine(ids[part].cuda()), labels[part].cuda())
                torch.cuda.set_sync_debug_mode("error")
                try:
                    engine.backward(loss, num_tokens=count)
                    results.append(engine.step())
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        return engine, results

    n = int((global_batch(5, 4)[1] != IGNORE).sum())
    on_host, _ = run([(n, n), (n, n)])
    count = torch.tensor(n, device="cuda")
    same = torch.tensor(float(n), device="cuda")  # an equal count in another tensor
    on_device, results = run([(count, count), (count, same)])
    assert [r.updated for r in results] == [False, True, False, True]
    for a, b in zip(on_device.module.parameters(), on_host.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    nan = torch.tensor(float("nan"), device="cuda")
    for counts in [(nan, nan), (count, torch.tensor(n + 1, device="cuda"))]:
        poisoned, results = run([counts])
        assert results[-1].skipped and poisoned.optimizer_steps == 0, counts


@requires_cuda(1)
def test_cuda_zero_token_count_skips_in_the_kernel_without_a_sync() -> None:
    """A window whose token count (on the GPU) is 0 is skipped inside the fused kernel: no
    host synchronisation in step() (sync debug mode), weights (weight decay) and schedule
    unchanged, the skip reported as one without loss tokens once its flag is read."""
    from _engine_models import IGNORE, global_batch, make_model, token_loss_sum
    from train_engine import Engine

    torch.manual_seed(0)
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine = Engine(model, opt, sched, max_grad_norm=0.3)
    before = [p.detach().clone() for p in model.parameters()]
    ids, labels = global_batch(5, 4)
    masked = torch.full_like(labels, IGNORE).cuda()
    loss = token_loss_sum(engine(ids.cuda()), masked)
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.backward(loss, num_tokens=torch.tensor(0, device="cuda"))
        result = engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.skipped and result.no_loss_tokens and engine.skipped_steps == 1
    assert sched.last_epoch == 0 and engine.optimizer_steps == 0
    for a, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(a, b)


@requires_cuda(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_master_weight_adamw_kernel_matches_float64_adamw(dtype: torch.dtype) -> None:
    import _master_adamw_check as check

    got = check.run("triton", "cuda", dtype=dtype)
    assert got["master_rel_err"] < 1e-6, got
    assert got["param_ulps"] == 0.0, got  # rounded to nearest, as torch's .to(bfloat16)
    assert got["skip_changed"] == 0.0, got
    assert got["step_count"] == 3.0, got
