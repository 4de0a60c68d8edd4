"""Engine semantics on one process: accumulation contracts, boundaries, policies, misuse."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _engine_models import (
    IGNORE,
    global_batch,
    make_model,
    reference_sgd_run,
    token_loss_mean,
    token_loss_sum,
)
from train_engine import Engine, NonFiniteGradientError, StepResult


def _sgd_engine(**kwargs) -> Engine:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Engine(model, opt, **kwargs)


def _micro_steps(engine: Engine, ids: torch.Tensor, labels: torch.Tensor, n: int) -> None:
    """``n`` backward + step calls on the same micro-batch (mean token loss)."""
    for _ in range(n):
        engine.backward(token_loss_mean(engine(ids), labels))
        engine.step()


def _params(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().clone() for k, v in engine.module.named_parameters()}


def test_contract_b_uneven_micro_batches_match_global_token_mean() -> None:
    reference = reference_sgd_run(
        steps=3, n_seq=8, lr=0.1, momentum=0.9, max_grad_norm=0.5, data_seed=40
    )
    engine = _sgd_engine(max_grad_norm=0.5, gradient_accumulation_steps=4)
    for step in range(3):
        ids, labels = global_batch(40 + step, 8)
        n = engine.global_num_tokens(int((labels != IGNORE).sum()))
        for mb in range(4):
            part = slice(2 * mb, 2 * mb + 2)
            engine.backward(token_loss_sum(engine(ids[part]), labels[part]), num_tokens=n)
            engine.step()
    got = _params(engine)
    err = max(float((got[k] - reference[k]).abs().max()) for k in reference)
    assert err < 2e-6, err


def test_contract_a_is_mean_of_micro_batch_means() -> None:
    """Float64 reference computed differently: average the per-micro-batch gradients by hand."""
    torch.manual_seed(0)
    engine = _sgd_engine(gradient_accumulation_steps=3)
    engine.optimizer.param_groups[0]["momentum"] = 0.0
    ref = make_model(dtype=torch.float64)
    ids, labels = global_batch(5, 6)
    grads: dict[str, torch.Tensor] = {}
    for mb in range(3):
        part = slice(2 * mb, 2 * mb + 2)
        ref.zero_grad()
        token_loss_mean(ref(ids[part]), labels[part]).backward()
        for k, p in ref.named_parameters():
            grads[k] = grads.get(k, 0) + p.grad / 3
        engine.backward(token_loss_mean(engine(ids[part]), labels[part]))
        result = engine.step()
    expected = {k: p.detach() - 0.1 * grads[k] for k, p in ref.named_parameters()}
    got = _params(engine)
    assert result.updated
    assert max(float((got[k] - expected[k]).abs().max()) for k in got) < 1e-6


def test_step_off_boundary_only_counts_and_scheduler_steps_once_per_window() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    engine = Engine(model, opt, sched, gradient_accumulation_steps=2)
    assert engine.get_global_grad_norm() is None
    ids, labels = global_batch(1, 2)
    results: list[StepResult] = []
    for _ in range(4):
        before = _params(engine)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.backward(token_loss_mean(engine(ids), labels))
        results.append(engine.step())
        changed = any(not torch.equal(before[k], v) for k, v in _params(engine).items())
        assert changed == boundary
    assert [r.updated for r in results] == [False, True, False, True]
    assert [r.grad_norm is None for r in results] == [True, False, True, False]
    assert [r.lrs for r in results] == [(1.0,), (1.0,), (0.5,), (0.5,)]
    assert opt.param_groups[0]["lr"] == 0.25
    assert engine.optimizer_steps == 2 and results[-1].optimizer_steps == 2
    assert engine.get_global_grad_norm() == pytest.approx(float(results[-1].grad_norm))
    assert all(p.grad is None for p in model.parameters()), "gradients not cleared"
    assert engine.state_dict() == {
        "micro_step": 0,
        "optimizer_steps": 2,
        "skipped_steps": 0,
        "windows": 2,
        "gradient_accumulation_steps": 2,
    }


def test_shorter_last_window() -> None:
    engine = _sgd_engine(gradient_accumulation_steps=3)
    ids, labels = global_batch(2, 2)
    _micro_steps(engine, ids, labels, 3)
    engine.set_gradient_accumulation_steps(2)
    assert not engine.is_gradient_accumulation_boundary()
    engine.backward(token_loss_mean(engine(ids), labels))
    assert not engine.step().updated
    assert engine.is_gradient_accumulation_boundary()
    engine.backward(token_loss_mean(engine(ids), labels))
    assert engine.step().updated and engine.optimizer_steps == 2


@pytest.mark.parametrize("policy", ["skip", "raise", "step"])
def test_nonfinite_policies_single_process(policy: str) -> None:
    engine = _sgd_engine(nonfinite=policy, max_grad_norm=1.0)
    ids, labels = global_batch(4, 2)
    before = _params(engine)
    engine.backward(token_loss_mean(engine(ids), labels) * math.inf)
    if policy == "raise":
        with pytest.raises(NonFiniteGradientError, match="non-finite global gradient norm"):
            engine.step()
    else:
        result = engine.step()
        assert result.skipped is (policy == "skip") and result.updated is (policy == "step")
        assert not math.isfinite(float(result.grad_norm))
    unchanged = all(torch.equal(before[k], v) for k, v in _params(engine).items())
    assert unchanged is (policy != "step")
    assert engine.skipped_steps == (0 if policy == "step" else 1)


def test_misuse_errors() -> None:
    engine = _sgd_engine(gradient_accumulation_steps=2)
    ids, labels = global_batch(6, 2)
    with pytest.raises(RuntimeError, match="step\\(\\) without a backward"):
        engine.step()
    out = engine(ids)
    with pytest.raises(ValueError, match="scalar \\(0-dim\\)"):
        engine.backward(out.sum(-1))
    with pytest.raises(ValueError, match="does not require grad"):
        engine.backward(token_loss_mean(out, labels).detach())
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        engine.backward(1.0)  # type: ignore[arg-type]
    engine.backward(token_loss_mean(out, labels))
    engine.step()
    with pytest.raises(RuntimeError, match="middle of a window"):
        engine.set_gradient_accumulation_steps(4)
    with pytest.raises(ValueError, match="one contract per window"):
        engine.backward(token_loss_sum(engine(ids), labels), num_tokens=10)
    with pytest.raises(ValueError, match="int >= 1"):
        Engine(engine.module, engine.optimizer, gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        Engine(engine.module, engine.optimizer, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        Engine(engine.module, engine.optimizer, nonfinite="ignore")  # type: ignore[arg-type]

    counted = _sgd_engine(gradient_accumulation_steps=2)
    counted.backward(token_loss_sum(counted(ids), labels), num_tokens=10)
    counted.step()
    with pytest.raises(ValueError, match="num_tokens changed within a window"):
        counted.backward(token_loss_sum(counted(ids), labels), num_tokens=11)


def test_engine_unusable_after_failed_backward() -> None:
    engine = _sgd_engine()
    ids, labels = global_batch(7, 2)
    loss = token_loss_mean(engine(ids), labels)
    loss.backward(retain_graph=False)  # the graph is freed: the Engine's backward will fail
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        engine.backward(loss)
    for call in (lambda: engine(ids), engine.step, lambda: engine.backward(loss)):
        with pytest.raises(RuntimeError, match="unusable after a failed backward"):
            call()


def test_state_dict_roundtrip_and_validation() -> None:
    engine = _sgd_engine(gradient_accumulation_steps=2)
    ids, labels = global_batch(8, 2)
    _micro_steps(engine, ids, labels, 4)
    state = engine.state_dict()
    other = _sgd_engine()
    other.load_state_dict(state)
    assert other.state_dict() == state and other.gradient_accumulation_steps == 2
    with pytest.raises(ValueError, match="do not match"):
        other.load_state_dict({"micro_step": 0})
    with pytest.raises(ValueError, match="middle of a window"):
        other.load_state_dict({**state, "micro_step": 1})


def test_mid_window_zero_grad_starts_a_new_window(caplog: pytest.LogCaptureFixture) -> None:
    engine = _sgd_engine(gradient_accumulation_steps=2)
    ids, labels = global_batch(9, 2)
    engine.backward(token_loss_mean(engine(ids), labels))
    engine.step()
    engine.zero_grad()
    assert "window's gradients are discarded" in caplog.text
    assert engine.micro_step == 0
    assert all(p.grad is None for p in engine.module.parameters())


@settings(max_examples=10, deadline=None)
@given(cuts=st.sets(st.integers(1, 7), max_size=5), seed=st.integers(0, 1000))
def test_contract_b_any_uneven_split_matches_reference(cuts: set[int], seed: int) -> None:
    """Property: any split of the global batch into micro-batches of different sizes gives the
    update of the whole batch's token-mean loss."""
    reference = reference_sgd_run(
        steps=1, n_seq=8, lr=0.1, momentum=0.9, max_grad_norm=None, data_seed=seed
    )
    bounds = [0, *sorted(cuts), 8]
    engine = _sgd_engine(gradient_accumulation_steps=len(bounds) - 1)
    ids, labels = global_batch(seed, 8)
    n = engine.global_num_tokens(int((labels != IGNORE).sum()))
    for lo, hi in itertools.pairwise(bounds):
        engine.backward(token_loss_sum(engine(ids[lo:hi]), labels[lo:hi]), num_tokens=n)
        result = engine.step()
    assert result.updated
    got = _params(engine)
    assert max(float((got[k] - reference[k]).abs().max()) for k in got) < 2e-6


def _fused_run(windows: list[tuple[int, float]], *, nonfinite: str) -> tuple[Engine, list]:
    """Fused AdamW + a decaying LambdaLR; each window is (data seed, loss multiplier)."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine = Engine(model, opt, sched, max_grad_norm=0.3, nonfinite=nonfinite)  # type: ignore[arg-type]
    results = []
    for seed, factor in windows:
        ids, labels = global_batch(seed, 4)
        engine.backward(token_loss_mean(engine(ids), labels) * factor)
        results.append(engine.step())
    return engine, results


def test_fused_optimizer_skip_on_device_equals_leaving_the_window_out() -> None:
    """The device-decided skip must leave parameters, optimizer state, scheduler and counters
    exactly as if the non-finite window never happened (compared bitwise)."""
    clean, _ = _fused_run([(1, 1.0), (2, 1.0), (3, 1.0)], nonfinite="skip")
    engine, results = _fused_run([(1, 1.0), (9, math.inf), (2, 1.0), (3, 1.0)], nonfinite="skip")
    assert [r.skipped for r in results] == [False, True, False, False]
    assert [r.updated for r in results] == [True, False, True, True]
    assert [r.optimizer_steps for r in results] == [1, 1, 2, 3]
    assert engine.optimizer_steps == 3 and engine.skipped_steps == 1
    for (name, a), b in zip(
        engine.module.named_parameters(), clean.module.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    for a, b in zip(engine.optimizer.state.values(), clean.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert engine.lr_scheduler.state_dict() == clean.lr_scheduler.state_dict()  # type: ignore[union-attr]
    assert engine.optimizer.param_groups[0]["lr"] == clean.optimizer.param_groups[0]["lr"]
    assert "skipped=True" in repr(results[1])


def test_fused_optimizer_clips_inside_the_update_like_clip_grad_norm() -> None:
    """Clipping through the fused kernel's gradient divisor vs clip_grad_norm_ + fused AdamW."""
    engine, results = _fused_run([(1, 1.0), (2, 1.0), (3, 1.0)], nonfinite="step")
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for seed in (1, 2, 3):
        ids, labels = global_batch(seed, 4)
        token_loss_mean(model(ids), labels).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        assert float(norm) > 0.3  # clipping is active, so the test can fail
        opt.step()
        sched.step()
        opt.zero_grad()
    for (r,) in zip(results, strict=True):
        assert r.updated and not r.skipped
    for a, b in zip(engine.module.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_device_update_only_where_the_flag_lives_with_the_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Offloaded (CPU) parameters under a GPU backend take the host-read path: the fused CPU
    kernel must not read a flag still being copied from the GPU."""
    from train_engine import _device_update

    engine, _ = _fused_run([(1, 1.0)], nonfinite="skip")
    devices = engine._param_device_types
    assert _device_update.flag_on_param_device(devices)  # one process, CPU parameters
    monkeypatch.setattr(_device_update.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(_device_update.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(_device_update, "backend_device", lambda group: torch.device("cuda", 0))
    assert not _device_update.flag_on_param_device(devices)
    monkeypatch.setattr(_device_update, "backend_device", lambda group: torch.device("cpu"))
    assert _device_update.flag_on_param_device(devices)


def _host_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Engine sees the skip flag as living apart from the parameters: the host-read path."""
    import train_engine.engine as engine_module

    monkeypatch.setattr(engine_module, "flag_on_param_device", lambda device_types: False)


def test_fused_optimizer_on_the_host_path_still_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    _host_path(monkeypatch)
    clean, _ = _fused_run([(1, 1.0), (2, 1.0)], nonfinite="skip")
    engine, results = _fused_run([(1, 1.0), (9, math.inf), (2, 1.0)], nonfinite="skip")
    assert [r.skipped for r in results] == [False, True, False]
    assert results[1]._pending is None  # decided on the host
    for a, b in zip(engine.module.parameters(), clean.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_loading_state_drops_an_unread_device_skip() -> None:
    """A loaded state replaces the pending (device-decided) update: reading its flag afterwards
    must not roll the freshly loaded scheduler back to the pre-skip snapshot."""
    engine, _ = _fused_run([(1, 1.0)], nonfinite="skip")
    # The state after the first window (as a checkpoint would hold it)...
    saved_engine = engine.state_dict()
    saved_sched = engine.lr_scheduler.state_dict()  # type: ignore[union-attr]
    saved_lr = engine.optimizer.param_groups[0]["lr"]
    # ...then one more update and a window skipped on the device, its flag not read yet.
    for seed, factor in ((2, 1.0), (9, math.inf)):
        ids, labels = global_batch(seed, 4)
        engine.backward(token_loss_mean(engine(ids), labels) * factor)
        result = engine.step()
    engine.lr_scheduler.load_state_dict(saved_sched)  # type: ignore[union-attr]
    engine.optimizer.param_groups[0]["lr"] = saved_lr
    engine.load_state_dict(saved_engine)
    assert engine.state_dict() == saved_engine
    assert engine.lr_scheduler.state_dict() == saved_sched  # type: ignore[union-attr]
    assert engine.optimizer.param_groups[0]["lr"] == saved_lr
    # The old step's result still reports the skip, and reading it restores nothing.
    assert result.skipped
    assert engine.lr_scheduler.state_dict() == saved_sched  # type: ignore[union-attr]
    assert engine.optimizer.param_groups[0]["lr"] == saved_lr


@pytest.mark.parametrize("path", ["device", "host", "plain"])
def test_step_results_carry_the_engines_run_of_skips(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each boundary StepResult says how many windows were skipped in a row up to it, the same
    count as engine.consecutive_skipped_steps, whether the skip was decided on the device
    (fused AdamW), on the host (fused AdamW, flag elsewhere) or by a plain optimizer; an
    off-boundary result repeats the last window's count."""
    if path == "host":
        _host_path(monkeypatch)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=path != "plain")
    engine = Engine(model, opt, gradient_accumulation_steps=2, nonfinite="skip")
    windows = [1.0, math.inf, math.inf, 1.0, math.inf]
    boundary, off_boundary, engine_counts = [], [], []
    for window, factor in enumerate(windows):
        for micro in range(2):
            ids, labels = global_batch(10 * window + micro, 4)
            loss = token_loss_mean(engine(ids), labels)
            engine.backward(loss * (factor if micro == 1 else 1.0))
            (boundary if micro == 1 else off_boundary).append(engine.step())
        engine_counts.append(engine.consecutive_skipped_steps)
    assert [r.skipped for r in boundary] == [False, True, True, False, True]
    assert [r.consecutive_skipped_steps for r in boundary] == [0, 1, 2, 0, 1]
    assert engine_counts == [0, 1, 2, 0, 1]
    # Micro-batch 0 of window w reports the run of skips up to window w - 1.
    assert [r.consecutive_skipped_steps for r in off_boundary] == [0, 0, 1, 2, 0]
    assert "consecutive_skipped_steps=1" in repr(boundary[-1])
