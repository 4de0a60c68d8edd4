"""Checks every published package's tests make of its own metadata: version and ``__all__``."""

from __future__ import annotations

from importlib.metadata import metadata
from types import ModuleType

__all__ = ["assert_all_is_exported", "assert_version_matches_metadata"]


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
