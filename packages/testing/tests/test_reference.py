import pytest
import torch
import torch.nn.functional as F

from train_testing.reference import (
    grads_of,
    max_relative_error,
    relative_error,
    token_log_probs,
    token_sum_cross_entropy,
    worst_grad_error,
)


def test_token_sum_cross_entropy_is_torchs_sum_cross_entropy() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, :2] = -100
    got = token_sum_cross_entropy(logits, labels)
    want = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(got, want)
    (g,) = torch.autograd.grad(got, logits)
    (w,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g, w)
    assert got.dtype == torch.float64


def test_token_log_probs_is_zero_where_ignored_even_over_masked_columns() -> None:
    logits = torch.randn(3, 6)
    logits[:, 0] = float("-inf")
    labels = torch.tensor([0, -100, 4])
    log_p = token_log_probs(logits, labels, temperature=0.5)
    assert log_p[0] == float("-inf") and log_p[1] == 0 and torch.isfinite(log_p[2])
    assert log_p.dtype == torch.float64


def test_grads_of_copies_in_float64_and_handles_missing() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model[0](torch.randn(4, 3)).sum().backward()
    grads = grads_of(model)
    assert set(grads) == {"0.weight", "0.bias"}
    assert all(g.dtype == torch.float64 for g in grads.values())
    grads["0.weight"].add_(1.0)  # a copy: the model's gradient is untouched
    assert not torch.equal(model[0].weight.grad.double(), grads["0.weight"])
    assert torch.equal(
        grads_of(model, missing="zeros")["1.bias"], torch.zeros(2, dtype=torch.float64)
    )
    with pytest.raises(AssertionError, match=r"1\.weight got no gradient"):
        grads_of(model, missing="raise")


def test_errors_name_the_worst_parameter() -> None:
    want = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([4.0, 0.0])}
    got = {"a": torch.tensor([1.0, -2.2]), "b": torch.tensor([4.0, 0.0])}
    assert max_relative_error(got["a"], want["a"]) == pytest.approx(0.1)
    assert relative_error(got["a"], want["a"]) == pytest.approx(0.2 / 5**0.5)
    assert worst_grad_error(got, want) == (pytest.approx(0.1), "a")
    assert worst_grad_error(want, want) == (0.0, "")
    assert worst_grad_error({}, want)[0] == pytest.approx(1.0)
