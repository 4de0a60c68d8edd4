from importlib.metadata import metadata

import cp_sharder


def test_version_matches_installed_metadata() -> None:
    assert cp_sharder.__version__ == metadata("cp-sharder")["Version"]


def test_public_api_is_exported() -> None:
    for name in cp_sharder.__all__:
        assert hasattr(cp_sharder, name), (
            f"cp_sharder.__all__ names {name!r} but the package lacks it"
        )
