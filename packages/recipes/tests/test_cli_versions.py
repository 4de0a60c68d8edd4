from importlib.metadata import version

import train_recipes
from train_recipes.cli.main import COMPONENTS, main, pinned_components


def test_every_component_is_pinned_exactly() -> None:
    pins = pinned_components()
    assert sorted(pins) == sorted(COMPONENTS)


def test_versions_command_reports_the_installed_set(capsys) -> None:
    status = main(["versions"])
    out = capsys.readouterr().out
    assert f"train-recipes {train_recipes.__version__}" in out
    for name in COMPONENTS:
        assert name in out
    expected = all(version(n) == v for n, v in pinned_components().items())
    assert status == (0 if expected else 1)
