import types

import pytest

import train_testing
from train_testing.package_checks import assert_all_is_exported, assert_version_matches_metadata


def test_version_check_fails_on_a_stale_version() -> None:
    stale = types.ModuleType("stale_pkg")
    stale.__version__ = "0.0.0.stale"  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match=r"stale_pkg.__version__ is '0.0.0.stale'"):
        assert_version_matches_metadata(stale, "train-testing")


def test_export_check_names_the_missing_name() -> None:
    assert_all_is_exported(train_testing)
    broken = types.ModuleType("broken_pkg")
    broken.__all__ = ["present", "absent"]  # type: ignore[attr-defined]
    broken.present = 1  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="'absent'"):
        assert_all_is_exported(broken)
