"""vocab-parallel's README: its examples run and its API table matches the package (ReadmeChecks)."""

from train_testing.package_checks import ReadmeChecks


class TestReadme(ReadmeChecks):
    package = "vocab_parallel"
