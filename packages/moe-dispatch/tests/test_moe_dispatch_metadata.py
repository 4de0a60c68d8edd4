from importlib.metadata import metadata

import moe_dispatch


def test_version_matches_installed_metadata() -> None:
    assert moe_dispatch.__version__ == metadata("moe-dispatch")["Version"]


def test_public_api_is_exported() -> None:
    for name in moe_dispatch.__all__:
        assert hasattr(moe_dispatch, name), (
            f"moe_dispatch.__all__ names {name!r} but the package lacks it"
        )
