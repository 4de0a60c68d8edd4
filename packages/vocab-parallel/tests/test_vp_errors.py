"""Bad input raises early with a message naming the value, the expectation and the fix."""

from __future__ import annotations

import math

import pytest
import torch

import vocab_parallel as vp


def _logits() -> torch.Tensor:
    return torch.randn(2, 3, 11)


def test_label_shape_mismatch_names_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 4\).*need shape \(2, 3\)"):
        vp.token_log_probs(_logits(), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"shape \(6,\)"):
        vp.cross_entropy(_logits(), torch.zeros(6, dtype=torch.long))


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.inf, math.nan])
def test_bad_temperature(temperature: float) -> None:
    labels = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        vp.token_log_probs(_logits(), labels, temperature=temperature)
    with pytest.raises(ValueError, match="temperature"):
        vp.token_entropy(_logits(), temperature=temperature)
    with pytest.raises(ValueError, match="temperature"):
        vp.linear_token_log_probs(
            torch.randn(2, 4), torch.randn(5, 4), labels[0, :2], temperature=temperature
        )


@pytest.mark.parametrize("bad", [11, 12, -1, -7])
def test_out_of_range_labels_are_caught_with_validate(bad: int) -> None:
    labels = torch.tensor([[0, -100, 3], [bad, 10, 4]])
    with pytest.raises(ValueError, match=rf"1 label\(s\) are outside \[0, 11\).*\[{bad}\]"):
        vp.token_log_probs(_logits(), labels, validate=True)
    with pytest.raises(ValueError, match="outside"):
        vp.cross_entropy(_logits(), labels, validate=True)
    with pytest.raises(ValueError, match="outside"):
        vp.linear_token_log_probs(torch.randn(2, 3, 4), torch.randn(11, 4), labels, validate=True)
    # Without validation nothing is read out of bounds (an out-of-bounds gather would raise on
    # CPU): the call succeeds and only the bad position is meaningless.
    good = labels.clone()
    good[1, 0] = 0
    logits = _logits()
    out = vp.token_log_probs(logits, labels)
    ref = vp.token_log_probs(logits, good)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 0] = False
    assert torch.equal(out[mask], ref[mask])


def test_valid_labels_pass_validation() -> None:
    labels = torch.tensor([[0, -100, 10], [5, 10, 4]])
    out = vp.token_log_probs(_logits(), labels, validate=True)
    assert torch.isfinite(out).all()


def test_type_errors() -> None:
    with pytest.raises(TypeError, match="floating dtype"):
        vp.token_log_probs(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer dtype"):
        vp.token_log_probs(torch.randn(2, 5), torch.zeros(2))
    with pytest.raises(TypeError, match="cast one of them"):
        vp.linear_token_log_probs(
            torch.randn(2, 4), torch.randn(5, 4).double(), torch.zeros(2, dtype=torch.long)
        )


def test_value_errors() -> None:
    labels = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        vp.token_log_probs(_logits(), labels, chunk_size=0)
    with pytest.raises(ValueError, match="reduction must be"):
        vp.cross_entropy(_logits(), labels, reduction="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        vp.cross_entropy(_logits(), labels, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"expected hidden \[\.\.\., 4\]"):
        vp.linear_token_log_probs(torch.randn(3, 5), torch.randn(7, 4), labels[0])
    with pytest.raises(ValueError, match=r"weight must be \[V, H\]"):
        vp.linear_token_log_probs(torch.randn(3, 4), torch.randn(7, 4, 1), labels[0])
    with pytest.raises(ValueError, match="at least one dim"):
        vp.token_entropy(torch.tensor(1.0))
