"""A window's bf16 gradients are summed in fp32 and rounded once (unwrapped models)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _engine_models import IGNORE, global_batch, make_model, token_loss_sum
from train_engine import Engine

MICRO_BATCHES = 32


class _GradSpy(torch.optim.SGD):
    """SGD with lr 0 that keeps a copy of the gradient each parameter had at every step."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, lr=0.0)
        self.seen: list[list[torch.Tensor | None]] = []

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        group = self.param_groups[0]["params"]
        self.seen.append([None if p.grad is None else p.grad.clone() for p in group])
        return super().step(closure)


def _model() -> nn.Module:
    model = make_model(seed=3, dtype=torch.bfloat16)
    model.unused = nn.Linear(2, 2).to(torch.bfloat16)  # never reached: keeps grad None
    return model


def _window_gradients(
    dtype: torch.dtype | None, windows: list[list[int]]
) -> list[list[torch.Tensor | None]]:
    """The gradients the optimizer saw at each window's update (micro-batches by seed)."""
    model = _model()
    spy = _GradSpy(list(model.parameters()))
    engine = Engine(model, spy, grad_accumulation_dtype=dtype)
    for seeds in windows:
        engine.set_gradient_accumulation_steps(len(seeds))
        batches = [global_batch(seed, 2) for seed in seeds]
        n = sum(int((labels != IGNORE).sum()) for _, labels in batches)
        for ids, labels in batches:
            engine.backward(token_loss_sum(engine(ids), labels), num_tokens=n)
            engine.step()
    return spy.seen


def _reference(seeds: list[int]) -> list[torch.Tensor | None]:
    """Float64 sum of each micro-batch's bf16 gradient, each from its own one-step window."""
    n = sum(int((global_batch(seed, 2)[1] != IGNORE).sum()) for seed in seeds)
    total: list[torch.Tensor | None] | None = None
    for seed in seeds:
        model = _model()
        spy = _GradSpy(list(model.parameters()))
        engine = Engine(model, spy)
        ids, labels = global_batch(seed, 2)
        engine.backward(token_loss_sum(engine(ids), labels), num_tokens=n)
        engine.step()
        grads = [None if g is None else g.double() for g in spy.seen[0]]
        if total is None:
            total = grads
        else:
            total = [None if a is None else a + b for a, b in zip(total, grads, strict=True)]
    assert total is not None
    return total


def _ulps_off(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of bf16's spacing at ``want`` (want in float64)."""
    spacing = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(want.abs())))
    return (got.double() - want).abs() / spacing.clamp_min(1e-30)


def test_a_long_bf16_window_is_rounded_once() -> None:
    seeds = list(range(100, 100 + MICRO_BATCHES))
    want = _reference(seeds)
    wide = _window_gradients(torch.float32, [seeds])[0]
    narrow = _window_gradients(None, [seeds])[0]
    worst_wide = 0.0
    off_wide = off_narrow = total = 0
    for got_wide, got_narrow, ref in zip(wide, narrow, want, strict=True):
        if ref is None:  # the unused layer: no gradient in any mode
            assert got_wide is None and got_narrow is None
            continue
        assert got_wide is not None and got_wide.dtype == torch.bfloat16
        assert got_narrow is not None
        nonzero = ref != 0
        ulps = _ulps_off(got_wide, ref)[nonzero]
        worst_wide = max(worst_wide, float(ulps.max()))
        off_wide += int((ulps > 0.5).sum())
        off_narrow += int((_ulps_off(got_narrow, ref)[nonzero] > 0.5).sum())
        total += int(nonzero.sum())
    # fp32 sums of bf16 values are exact here, so one rounding to nearest: at most half a unit.
    assert worst_wide <= 0.5 + 1e-6, worst_wide
    assert off_wide == 0
    # The negative control: autograd's bf16 accumulation rounds 31 more times.
    assert off_narrow > total // 4, (off_narrow, total)


def test_windows_start_from_zero_and_zero_grad_discards_the_sums() -> None:
    first, second = [200, 201, 202], [300, 301]
    windows = _window_gradients(torch.float32, [first, second])
    for got, ref in zip(windows[1], _reference(second), strict=True):
        if ref is None:
            continue
        assert got is not None
        assert float(_ulps_off(got, ref)[ref != 0].max()) <= 0.5 + 1e-6

    model = _model()
    spy = _GradSpy(list(model.parameters()))
    engine = Engine(model, spy, gradient_accumulation_steps=2)
    ids, labels = global_batch(400, 2)
    n = int((labels != IGNORE).sum())
    engine.backward(token_loss_sum(engine(ids), labels), num_tokens=2 * n)
    engine.step()
    engine.zero_grad()  # mid-window: the folded micro-batch is discarded
    for _ in range(2):
        engine.backward(token_loss_sum(engine(ids), labels), num_tokens=2 * n)
        engine.step()
    for got, ref in zip(spy.seen[0], _reference([400, 400]), strict=True):
        if ref is None:
            continue
        assert got is not None
        assert float(_ulps_off(got, ref)[ref != 0].max()) <= 0.5 + 1e-6


def test_only_narrow_parameters_of_unwrapped_models_are_summed() -> None:
    fp32 = make_model()
    assert Engine(fp32, torch.optim.SGD(fp32.parameters(), lr=0.1))._wide_grads.narrow_params == 0
    bf16 = _model()
    opt = torch.optim.SGD(bf16.parameters(), lr=0.1)
    assert Engine(bf16, opt, grad_accumulation_dtype=None)._wide_grads.narrow_params == 0
    wide = Engine(bf16, opt)._wide_grads
    assert wide.narrow_params == len(list(bf16.parameters()))
    for bad in (torch.int32, "float32"):
        with pytest.raises(ValueError, match="grad_accumulation_dtype must be a floating dtype"):
            Engine(bf16, opt, grad_accumulation_dtype=bad)  # type: ignore[arg-type]
