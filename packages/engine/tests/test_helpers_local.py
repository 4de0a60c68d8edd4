"""param_groups and LossWindow on one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _engine_models import make_model
from train_engine import LossWindow, param_groups


def test_param_groups_default_rule_and_optimizer_construction() -> None:
    model = make_model()
    model.head.weight = model.embed.weight  # tied: must appear once
    model.layers[0].w2.weight.requires_grad_(False)  # frozen: left out
    groups = param_groups(model, weight_decay=0.05)
    opt = torch.optim.AdamW(groups, lr=1e-3)
    decay = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    assert decay["embed.weight"] == 0.05 and decay["layers.1.w1.weight"] == 0.05
    assert decay["layers.0.norm.weight"] == 0.0 and decay["layers.0.norm.bias"] == 0.0
    assert decay["head.bias"] == 0.0
    assert "head.weight" not in decay and "layers.0.w2.weight" not in decay
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert set(ids) == trainable


def test_param_groups_custom_rule_and_errors() -> None:
    model = nn.Linear(3, 2)
    groups = param_groups(model, weight_decay=0.1, no_decay=lambda n, p: n == "weight")
    assert [g["param_names"] for g in groups] == [["bias"], ["weight"]]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        param_groups(model, weight_decay=-1)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        param_groups(model, weight_decay=0.1)


def test_loss_window_local() -> None:
    window = LossWindow(steps=3)
    assert window.average() is None and window.last() is None and len(window) == 0
    values = [1.0, 2.0, 4.0, 8.0, 16.0]
    for v in values:
        window.update(torch.tensor(v))
    assert len(window) == 3
    assert window.average() == pytest.approx(sum(values[-3:]) / 3)
    assert window.last() == 16.0
    window.update(3.0)
    assert window.average() == pytest.approx((4 + 8 + 16 + 3 - 4) / 3)
    window.reset()
    assert window.average() is None
    with pytest.raises(ValueError, match="steps must be an int > 0"):
        LossWindow(steps=0)
    with pytest.raises(ValueError, match="one value"):
        LossWindow().update(torch.ones(2))


def test_loss_window_token_sum_contract_local() -> None:
    # Contract (b) on one process: the window reads the step's token-loss sum / its tokens.
    window = LossWindow(steps=2)
    window.update(torch.tensor(6.0, dtype=torch.float64), torch.tensor(4))
    assert window.last() == 1.5
    window.update(torch.tensor(9.0), 3)
    assert window.last() == 3.0
    assert window.average() == pytest.approx((6 / 4 + 9 / 3) / 2)


@pytest.mark.parametrize("saved_after", [0, 2, 5, 7, 11])
def test_loss_window_state_dict_resumes_exactly(saved_after: int, tmp_path) -> None:
    # Values of very different magnitudes: a different summation order changes the last bits,
    # so the comparison is bitwise, not approximate.
    gen = torch.Generator().manual_seed(saved_after)
    losses = (
        torch.rand(16, generator=gen, dtype=torch.float64)
        * 10.0 ** torch.randint(-8, 8, (16,), generator=gen)
    ).tolist()
    uninterrupted, before = LossWindow(steps=5), LossWindow(steps=5)
    for value in losses[:saved_after]:
        uninterrupted.update(torch.tensor(value, dtype=torch.float32).double())
        before.update(torch.tensor(value, dtype=torch.float32).double())
    state = before.state_dict()
    assert {type(v) for v in state["values"]} <= {float}
    torch.save(state, tmp_path / "window.pt")
    resumed = LossWindow(steps=5)
    resumed.update(123.0)  # contents are replaced, not merged
    resumed.load_state_dict(torch.load(tmp_path / "window.pt", weights_only=True))
    assert len(resumed) == len(uninterrupted)
    assert resumed.average() == uninterrupted.average()
    assert resumed.last() == uninterrupted.last()
    for value in losses[saved_after:]:
        for window in (uninterrupted, resumed):
            window.update(torch.tensor(value, dtype=torch.float32).double())
        assert resumed.average() == uninterrupted.average()
        assert resumed.last() == uninterrupted.last()
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_loss_window_state_dict_other_length_and_errors() -> None:
    saved = LossWindow(steps=4)
    for value in [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]:  # ring [5, 6, 3, 4]
        saved.update(value)
    shorter = LossWindow(steps=3)
    shorter.load_state_dict(saved.state_dict())
    assert (len(shorter), shorter.average(), shorter.last()) == (3, 5.0, 6.0)
    shorter.update(10.0)  # overwrites the oldest kept loss (4.0)
    assert shorter.average() == pytest.approx((5 + 6 + 10) / 3)
    longer = LossWindow(steps=8)
    longer.load_state_dict(saved.state_dict())
    assert (len(longer), longer.average(), longer.last()) == (4, 4.5, 6.0)
    empty = LossWindow(steps=4)
    empty.update(1.0)
    empty.load_state_dict(LossWindow(steps=4).state_dict())
    assert len(empty) == 0 and empty.average() is None
    with pytest.raises(ValueError, match="not a LossWindow state of version 1"):
        empty.load_state_dict({"steps": 4})
    with pytest.raises(ValueError, match="inconsistent LossWindow state"):
        empty.load_state_dict({"version": 1, "steps": 4, "count": 6, "values": [1.0]})
