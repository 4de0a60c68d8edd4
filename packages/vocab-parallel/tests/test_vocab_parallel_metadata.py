import vocab_parallel
from train_testing.package_checks import assert_all_is_exported, assert_version_matches_metadata


def test_version_matches_installed_metadata() -> None:
    assert_version_matches_metadata(vocab_parallel, "vocab-parallel")


def test_public_api_is_exported() -> None:
    assert_all_is_exported(vocab_parallel)
