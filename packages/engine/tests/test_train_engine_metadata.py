from importlib.metadata import metadata

import train_engine


def test_version_matches_installed_metadata() -> None:
    assert train_engine.__version__ == metadata("train-engine")["Version"]


def test_public_api_is_exported() -> None:
    for name in train_engine.__all__:
        assert hasattr(train_engine, name), (
            f"train_engine.__all__ names {name!r} but the package lacks it"
        )
