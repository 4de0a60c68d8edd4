import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from train_testing.import_graph import assert_no_import_cycles, find_cycles, import_graph


@pytest.fixture
def make_package(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], str]]:
    """Write a throwaway package ``pkg_<n>`` under tmp_path and put it on sys.path."""
    sys.path.insert(0, str(tmp_path))
    made: list[str] = []

    def make(files: dict[str, str]) -> str:
        name = f"cyc_pkg_{len(made)}_{tmp_path.name}".replace("-", "_")
        for rel, text in files.items():
            path = tmp_path / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text.replace("PKG", name))
        made.append(name)
        return name

    yield make
    sys.path.remove(str(tmp_path))


def test_a_function_local_import_closes_a_cycle(make_package) -> None:
    pkg = make_package(
        {
            "__init__.py": "from PKG.a import f\n",
            "a.py": "from PKG.b import g\n\ndef f():\n    return g()\n",
            "b.py": "def g():\n    from PKG import a\n    return a\n",
        }
    )
    assert find_cycles(import_graph(pkg)) == [[f"{pkg}.a", f"{pkg}.b", f"{pkg}.a"]]
    with pytest.raises(AssertionError, match=r"b\.py:2, function"):
        assert_no_import_cycles(pkg)


def test_type_checking_and_relative_imports_count(make_package) -> None:
    pkg = make_package(
        {
            "__init__.py": "",
            "sub/__init__.py": "",
            "sub/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..y import Y\n",
            "y.py": "from .sub import x\nclass Y: ...\n",
        }
    )
    with pytest.raises(AssertionError, match="TYPE_CHECKING") as info:
        assert_no_import_cycles(pkg)
    assert f"{pkg}.sub.x -> {pkg}.y -> {pkg}.sub.x" in str(info.value)


def test_the_facade_is_not_an_implicit_edge(make_package) -> None:
    # Every module's parent package runs first, but only a named import is an edge: the facade
    # importing its modules is no cycle, a module importing a name from the facade is one.
    pkg = make_package(
        {
            "__init__.py": "from PKG.a import A\nfrom PKG.b import B\n",
            "a.py": "class A: ...\n",
            "b.py": "from PKG.a import A\nclass B(A): ...\n",
        }
    )
    assert_no_import_cycles(pkg)
    back = make_package(
        {
            "__init__.py": "from PKG.a import A\nVALUE = 1\n",
            "a.py": "from PKG import VALUE\nA = VALUE\n",
        }
    )
    assert find_cycles(import_graph(back)) == [[back, f"{back}.a", back]]


def test_train_testing_has_no_cycle() -> None:
    assert_no_import_cycles("train_testing")
