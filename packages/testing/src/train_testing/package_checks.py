"""Checks every published package's tests make of itself: version, ``__all__`` and README."""

from __future__ import annotations

from importlib.metadata import metadata
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest

from train_testing.readme_examples import (
    run_readme_examples,
    unimportable_api_names,
    unlisted_exports,
)

__all__ = ["ReadmeChecks", "assert_all_is_exported", "assert_version_matches_metadata"]


def assert_version_matches_metadata(package: ModuleType, dist: str) -> None:
    """``package.__version__`` equals the installed distribution's ``Version`` field.

    Args:
        package: the imported top-level package, e.g. ``cp_sharder``.
        dist: its distribution name, e.g. ``"cp-sharder"``.

    Raises:
        AssertionError: the two differ (a stale hard-coded version, or a second install).
    """
    installed = metadata(dist)["Version"]
    assert package.__version__ == installed, (
        f"{package.__name__}.__version__ is {package.__version__!r} but the installed {dist} "
        f"is {installed!r}; read the version from importlib.metadata instead of writing it twice"
    )


def assert_all_is_exported(package: ModuleType) -> None:
    """Every name in ``package.__all__`` exists on the package.

    Raises:
        AssertionError: naming the first name ``__all__`` promises but the package lacks.
    """
    for name in package.__all__:
        assert hasattr(package, name), (
            f"{package.__name__}.__all__ names {name!r} but the package lacks it"
        )


class ReadmeChecks:
    """The README checks of a package's tests: subclass it as ``TestReadme`` and set ``package``.

    The README is ``README.md`` of the folder above the test file's (``packages/<folder>/tests/``
    -> ``packages/<folder>/README.md``). Every package makes the same three checks, so they live
    here once; pytest collects them through the ``Test`` subclass (this class's name does not
    start with ``Test``, so importing it collects nothing).

    Attributes:
        package: the import name the README documents, e.g. ``"cp_sharder"``.
    """

    package: ClassVar[str]

    @pytest.fixture
    def readme(self, request: pytest.FixtureRequest) -> Path:
        """The package's README: the test file's folder's parent's ``README.md``."""
        return request.path.parents[1] / "README.md"

    @pytest.mark.slow
    def test_the_readme_examples_run(self, readme: Path, tmp_path: Path) -> None:
        """Its ```` ```python run ```` blocks run, as one script (see ``readme_examples``)."""
        run_readme_examples(readme, tmp_path)

    def test_the_readme_api_table_lists_names_the_package_has(self, readme: Path) -> None:
        """Every name of its API table imports."""
        missing = unimportable_api_names(readme, self.package)
        assert not missing, "the README's API table names what the code lacks:\n" + "\n".join(
            missing
        )

    def test_every_exported_name_is_in_the_readme_api_table(self, readme: Path) -> None:
        """Every name of the package's ``__all__`` is in its API table."""
        unlisted = unlisted_exports(readme, self.package)
        assert not unlisted, (
            f"in {self.package}.__all__ but not in the README's API table: {unlisted}"
        )
