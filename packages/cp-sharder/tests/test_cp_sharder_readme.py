"""The README's examples run, and its API table lists what the package has.

The examples (``python run`` blocks) run on CPU as the one script they form; the API table's
convention is ``train_testing.readme_examples``'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from train_testing.readme_examples import (
    run_readme_examples,
    unimportable_api_names,
    unlisted_exports,
)

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_the_readme_examples_run(tmp_path: Path) -> None:
    run_readme_examples(README, tmp_path)


def test_the_readme_api_table_lists_names_the_package_has() -> None:
    missing = unimportable_api_names(README, "cp_sharder")
    assert not missing, "the README's API table names what the code lacks:\n" + "\n".join(missing)


def test_every_exported_name_is_in_the_readme_api_table() -> None:
    unlisted = unlisted_exports(README, "cp_sharder")
    assert not unlisted, f"in cp_sharder.__all__ but not in the README's API table: {unlisted}"
