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
