"""Engine misuse that used to pass silently (issue 17 item 9), the skip counters (item 6) and
windows without loss tokens (issue 43 item 2)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

import train_engine.engine as engine_module
from _engine_models import IGNORE, global_batch, make_model, reference_sgd_run, token_loss_sum
from train_engine import Engine, NonFiniteGradientError


def _engine(window: int = 1, **kwargs) -> Engine:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Engine(model, opt, gradient_accumulation_steps=window, **kwargs)


def _params(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().clone() for k, v in engine.module.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _window_of_two(engine: Engine, seed: int, num_tokens=None) -> None:
    """One window: the global batch of 4 sequences as two micro-batches of 2 (contract b)."""
    ids, labels = global_batch(seed, 4)
    n = int((labels != IGNORE).sum()) if num_tokens is None else num_tokens
    for part in (slice(0, 2), slice(2, 4)):
        engine.backward(token_loss_sum(engine(ids[part]), labels[part]), num_tokens=n)
        engine.step()


def test_second_backward_in_a_micro_batch_raises_and_does_not_double_the_gradient() -> None:
    reference = reference_sgd_run(
        steps=1, n_seq=4, lr=0.1, momentum=0.9, max_grad_norm=None, data_seed=3
    )
    engine = _engine(window=2)
    ids, labels = global_batch(3, 4)
    n = int((labels != IGNORE).sum())
    first = token_loss_sum(engine(ids[:2]), labels[:2])
    engine.backward(first, num_tokens=n)
    again = token_loss_sum(engine(ids[:2]), labels[:2])
    with pytest.raises(RuntimeError, match="backward\\(\\) called twice in micro-batch 1 of a 2"):
        engine.backward(again, num_tokens=n)
    # The refused backward left the window as it was: finishing it gives the exact update.
    engine.step()
    engine.backward(token_loss_sum(engine(ids[2:]), labels[2:]), num_tokens=n)
    assert engine.step().updated
    assert _max_diff(_params(engine), reference) < 2e-6


def test_more_backwards_than_the_window_raises() -> None:
    """The DeepSpeed-incorrect loop (all backwards, one step) is refused at its 2nd backward;
    one backward + step per micro-batch updates exactly once per window."""
    engine = _engine(window=3)
    ids, labels = global_batch(4, 2)
    engine.backward(token_loss_sum(engine(ids), labels), num_tokens=10)
    with pytest.raises(RuntimeError, match="called twice"):
        engine.backward(token_loss_sum(engine(ids), labels), num_tokens=10)
    engine.zero_grad()
    updates = []
    for _ in range(6):
        engine.backward(token_loss_sum(engine(ids), labels), num_tokens=10)
        updates.append(engine.step().updated)
    assert updates == [False, False, True, False, False, True]


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (True, TypeError, "got a bool"),
        (torch.tensor(True), TypeError, "got a bool"),
        (math.nan, ValueError, "finite and >= 0, got nan"),
        (math.inf, ValueError, "finite and >= 0, got inf"),
        (-3, ValueError, "finite and >= 0, got -3"),
        (torch.tensor(math.nan), ValueError, "finite and >= 0, got nan"),
        (torch.tensor(-1.0), ValueError, "finite and >= 0, got -1"),
        (torch.tensor([3, 4]), ValueError, "one value"),
        ("12", TypeError, "int, float or 0-dim tensor, got str"),
    ],
)
def test_invalid_num_tokens_raise_before_the_backward(bad, error, message) -> None:
    engine = _engine()
    ids, labels = global_batch(5, 2)
    loss = token_loss_sum(engine(ids), labels)
    with pytest.raises(error, match=message):
        engine.backward(loss, num_tokens=bad)
    assert all(p.grad is None for p in engine.module.parameters()), "a backward ran"
    engine.backward(loss, num_tokens=int((labels != IGNORE).sum()))  # still usable
    assert engine.step().updated


@pytest.mark.parametrize("second", [11, 11.0, torch.tensor(11)])
def test_num_tokens_changing_within_a_window_raises(second) -> None:
    engine = _engine(window=2)
    ids, labels = global_batch(6, 2)
    engine.backward(token_loss_sum(engine(ids), labels), num_tokens=torch.tensor(10))
    engine.step()
    with pytest.raises(ValueError, match="num_tokens changed within a window \\(10 then 11\\)"):
        engine.backward(token_loss_sum(engine(ids), labels), num_tokens=second)
    # An equal count of another type or object is the same count.
    engine.backward(token_loss_sum(engine(ids), labels), num_tokens=10.0)
    assert engine.step().updated


def _device_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the accelerator path for tensor counts on the CPU: validated on the device,
    never read on the host (what a CUDA count gets)."""
    real = engine_module.host_num_tokens

    def never_read(num_tokens: object) -> float | None:
        value = real(num_tokens) if not isinstance(num_tokens, torch.Tensor) else None
        if isinstance(num_tokens, torch.Tensor) and num_tokens.dtype == torch.bool:
            return real(num_tokens)
        return value

    monkeypatch.setattr(engine_module, "host_num_tokens", never_read)


def test_device_counts_give_the_exact_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid count on the device path (including an equal count in another tensor)."""
    _device_counts(monkeypatch)
    reference = reference_sgd_run(
        steps=2, n_seq=4, lr=0.1, momentum=0.9, max_grad_norm=None, data_seed=8
    )
    engine = _engine(window=2)
    for step in range(2):
        ids, labels = global_batch(8 + step, 4)
        n = int((labels != IGNORE).sum())
        for part, count in ((slice(0, 2), torch.tensor(n)), (slice(2, 4), torch.tensor(n))):
            engine.backward(token_loss_sum(engine(ids[part]), labels[part]), num_tokens=count)
            result = engine.step()
        assert result.updated
    assert _max_diff(_params(engine), reference) < 2e-6


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (torch.tensor(math.nan), None),
        (torch.tensor(math.inf), None),
        (torch.tensor(-4.0), None),
        (torch.tensor(10), torch.tensor(11)),
        (torch.tensor(10), 11),
    ],
)
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_invalid_device_counts_trip_the_nonfinite_policy(
    monkeypatch: pytest.MonkeyPatch, first, second, policy: str
) -> None:
    """Without a host read, an invalid count makes the window's gradient NaN: the update is
    skipped (or raises), never made with a wrong scale (inf and nan used to give a silent
    zero gradient)."""
    _device_counts(monkeypatch)
    engine = _engine(window=2, nonfinite=policy)
    before = _params(engine)
    ids, labels = global_batch(9, 2)
    engine.backward(token_loss_sum(engine(ids), labels), num_tokens=first)
    engine.step()
    engine.backward(
        token_loss_sum(engine(ids), labels), num_tokens=first if second is None else second
    )
    if policy == "raise":
        with pytest.raises(NonFiniteGradientError):
            engine.step()
    else:
        result = engine.step()
        assert result.skipped and not result.updated
        assert math.isnan(float(result.grad_norm))
    assert _max_diff(_params(engine), before) == 0.0
    assert engine.skipped_steps == 1


@pytest.mark.parametrize("count", ["host", "device"])
@pytest.mark.parametrize("policy", ["skip", "raise", "step"])
@pytest.mark.parametrize("fused", [False, True])
def test_zero_token_window_is_skipped_under_every_policy(
    monkeypatch: pytest.MonkeyPatch, count: str, policy: str, fused: bool
) -> None:
    """A window without loss tokens has a zero gradient, but an update on it would still move
    the weights (AdamW's weight decay) and advance the schedule (issue 43 item 2): it is
    skipped and counted as a skip under every policy, with a host or a device count, decided
    on the host (plain AdamW, "raise") or in the fused kernel; the next window updates."""
    if count == "device":
        _device_counts(monkeypatch)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine = Engine(model, opt, sched, nonfinite=policy)  # type: ignore[arg-type]
    ids, labels = global_batch(3, 2)
    before = _params(engine)
    masked = torch.full_like(labels, IGNORE)
    engine.backward(token_loss_sum(engine(ids), masked), num_tokens=engine.global_num_tokens(0))
    result = engine.step()
    assert float(result.grad_norm) == 0.0
    assert result.skipped and result.no_loss_tokens and not result.updated, result
    assert _max_diff(_params(engine), before) == 0.0
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 0.05
    assert (engine.optimizer_steps, engine.skipped_steps) == (0, 1)
    assert result.consecutive_skipped_steps == engine.consecutive_skipped_steps == 1
    n = engine.global_num_tokens(int((labels != IGNORE).sum()))
    engine.backward(token_loss_sum(engine(ids), labels), num_tokens=n)
    result = engine.step()
    assert result.updated and not result.no_loss_tokens and engine.optimizer_steps == 1
    assert engine.consecutive_skipped_steps == 0 and sched.last_epoch == 1


def test_optimizer_over_other_parameters_raises() -> None:
    model, other = make_model(), make_model()
    with pytest.raises(ValueError, match="holds 15 of 15 tensors that are not parameters"):
        Engine(model, torch.optim.SGD(other.parameters(), lr=0.1))
    mixed = torch.optim.SGD([*model.parameters(), *nn.Linear(2, 3).parameters()], lr=0.1)
    with pytest.raises(
        ValueError, match=r"2 of 17 .*param_groups\[0\]\['params'\]\[15\], shape \(3, 2\)"
    ):
        Engine(model, mixed)
    # A frozen parameter in the optimizer is still the model's: allowed.
    model.head.bias.requires_grad_(False)
    Engine(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_loss_not_connected_to_the_model_raises() -> None:
    engine = _engine(window=2)
    ids, labels = global_batch(10, 2)
    leaf = torch.tensor(1.0, requires_grad=True)
    with pytest.raises(ValueError, match="leaf tensor"):
        engine.backward(leaf)
    # A graph that never reaches the model: caught at the window's boundary.
    stranger = make_model(seed=3)
    for _ in range(2):
        engine.backward(token_loss_sum(stranger(ids), labels), num_tokens=5)
        if engine.is_gradient_accumulation_boundary():
            with pytest.raises(RuntimeError, match="no trainable parameter of the model received"):
                engine.step()
        else:
            engine.step()
    assert engine.micro_step == 0 and engine.optimizer_steps == 0
    # The window was discarded; the Engine goes on.
    _window_of_two(engine, seed=10)
    assert engine.optimizer_steps == 1


def test_saving_onto_a_file_or_a_foreign_directory_is_refused(tmp_path) -> None:
    engine = _engine()
    ids, labels = global_batch(11, 2)
    engine.backward(token_loss_sum(engine(ids), labels), num_tokens=5)
    engine.step()
    user_file = tmp_path / "notes.txt"
    user_file.write_text("precious")
    with pytest.raises(FileExistsError, match="is a file, not a checkpoint"):
        engine.save_checkpoint(user_file)
    assert user_file.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("{}")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        engine.save_checkpoint(data)
    assert (data / "train.jsonl").read_text() == "{}"
    # An existing checkpoint is replaced as before.
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "COMPLETE").is_file()


def _fused(nonfinite: str = "skip") -> Engine:
    model = make_model()
    return Engine(
        model, torch.optim.AdamW(model.parameters(), lr=0.01, fused=True), nonfinite=nonfinite
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [_engine, _fused], ids=["host", "device"])
def test_consecutive_skips_and_the_warning_names_the_step(
    make, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make()
    ids, labels = global_batch(12, 2)
    factors = [1.0, math.inf, math.inf, 1.0, math.inf]
    runs, skipped = [], []
    with caplog.at_level(logging.WARNING, logger="train_engine.engine"):
        for factor in factors:
            engine.backward(token_loss_sum(engine(ids), labels) * factor, num_tokens=7)
            result = engine.step()
            skipped.append(result.skipped)
            runs.append(engine.consecutive_skipped_steps)
    assert skipped == [False, True, True, False, True]
    assert runs == [0, 1, 2, 0, 1]
    assert engine.skipped_steps == 3 and engine.optimizer_steps == 2
    messages = [r.getMessage() for r in caplog.records if "skipped the update" in r.getMessage()]
    assert [m.split(" (")[0] for m in messages] == [
        "skipped the update of step 2",
        "skipped the update of step 3",
        "skipped the update of step 5",
    ]
    assert "2 in a row" in messages[1]
