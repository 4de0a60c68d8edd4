"""The README's examples run on CPU, as the one script they form (``python run`` blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.readme_examples import run_readme_examples


@pytest.mark.slow
def test_the_readme_examples_run(tmp_path: Path) -> None:
    run_readme_examples(Path(__file__).resolve().parents[1] / "README.md", tmp_path)
