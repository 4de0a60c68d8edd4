import pytest
import torch

from train_testing import requires_cuda, requires_module


def test_requires_cuda_skips_with_reason_when_gpus_are_missing() -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mark = requires_cuda(have + 1)
    assert mark.args == (True,)
    assert f"needs {have + 1} CUDA GPU(s)" in mark.kwargs["reason"]


def test_requires_module_names_the_extra() -> None:
    mark = requires_module("surely_not_a_module_xyz", extra="te")
    assert mark.args == (True,)
    assert "'te' extra" in mark.kwargs["reason"]
    assert requires_module("json", extra="x").args == (False,)


@requires_cuda(1)
def test_marker_applies_to_a_test() -> None:
    pytest.importorskip("torch")
    assert torch.cuda.is_available()
