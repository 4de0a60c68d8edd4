"""Markers that skip tests the current machine cannot run, with the reason in the report."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pytest is imported when a marker is made: bench scripts import the package
    import pytest


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_cuda(n_gpus: int = 1) -> pytest.MarkDecorator:
    """Skip unless at least ``n_gpus`` CUDA devices are visible.

    Example::

        @requires_cuda(2)
        def test_nccl_parity(): ...
    """
    import pytest

    available = _cuda_device_count()
    return pytest.mark.skipif(
        available < n_gpus,
        reason=f"needs {n_gpus} CUDA GPU(s), this machine has {available}; "
        "runs on the GPU machine (see the package README)",
    )


def requires_module(name: str, *, extra: str) -> pytest.MarkDecorator:
    """Skip unless the optional module ``name`` is importable, naming the extra that provides it."""
    import pytest

    present = importlib.util.find_spec(name) is not None
    return pytest.mark.skipif(
        not present,
        reason=f"optional module {name!r} is not installed (install the {extra!r} extra)",
    )
