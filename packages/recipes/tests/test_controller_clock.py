"""The Ray actor's step clock (controller/step_ms, controller/wait_ms), on a scripted clock."""

from __future__ import annotations

import pytest

from train_recipes.controller import rank_actor


def test_waits_count_from_the_last_call_of_any_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(rank_actor.time, "perf_counter", lambda: now[0])
    clock = rank_actor._StepClock()

    def call(duration: float, *, step: bool, after: float) -> None:
        now[0] += after  # idle: the driver's turn
        if step:
            clock.begin()
        now[0] += duration
        if step:
            clock.end()
        else:
            clock.other_call_ended()

    call(0.30, step=True, after=5.0)  # the first step follows setup: no wait counted
    assert clock.read() == pytest.approx({"controller/step_ms": 300.0})
    call(0.30, step=True, after=0.002)
    call(0.50, step=False, after=0.001)  # a checkpoint between two steps is not a wait
    call(0.30, step=True, after=0.004)
    assert clock.read() == pytest.approx({"controller/step_ms": 300.0, "controller/wait_ms": 3.0})
    call(0.10, step=True, after=0.010)
    assert clock.read() == pytest.approx({"controller/step_ms": 100.0, "controller/wait_ms": 10.0})
