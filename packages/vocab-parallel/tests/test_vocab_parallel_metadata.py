from importlib.metadata import metadata

import vocab_parallel


def test_version_matches_installed_metadata() -> None:
    assert vocab_parallel.__version__ == metadata("vocab-parallel")["Version"]


def test_public_api_is_exported() -> None:
    for name in vocab_parallel.__all__:
        assert hasattr(vocab_parallel, name), (
            f"vocab_parallel.__all__ names {name!r} but the package lacks it"
        )
