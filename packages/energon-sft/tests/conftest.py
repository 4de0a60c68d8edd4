"""Fixtures shared by energon-sft's test modules."""

from __future__ import annotations

from typing import Any

import pytest

from _esft_data import build_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny local tokenizer with its chat template (built once per test module)."""
    return build_tokenizer()
