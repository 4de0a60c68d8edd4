from importlib.metadata import metadata

import energon_sft


def test_version_matches_installed_metadata() -> None:
    assert energon_sft.__version__ == metadata("energon-sft")["Version"]


def test_public_api_is_exported() -> None:
    for name in energon_sft.__all__:
        assert hasattr(energon_sft, name), (
            f"energon_sft.__all__ names {name!r} but the package lacks it"
        )
