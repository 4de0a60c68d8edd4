"""A package's own import graph, read from its source with ``ast``, and the cycles in it.

A cycle between two modules of one package often hides behind a function-local or
``TYPE_CHECKING`` import: Python accepts it, but the two modules cannot be read, tested or moved
apart. So every import statement counts here, wherever it stands (module level, inside a
function, under ``if TYPE_CHECKING:``); only imports of the package's own modules make edges.

Edges follow what the statement names, not what Python runs first: ``from pkg import sub``
(a submodule) is an edge to ``pkg.sub``; ``from pkg import name`` (not a submodule) is an edge to
``pkg`` itself, the facade, which is a back edge when a private module does it. The implicit
import of every parent package is not an edge (every module would reach ``__init__``, and
``__init__`` every module).

Nothing is imported: the source files are found with ``importlib.util.find_spec`` and parsed.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ImportEdge",
    "assert_no_import_cycles",
    "find_cycles",
    "import_graph",
    "package_modules",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class ImportEdge:
    """One import statement of a module that names another module of the same package.

    Attributes:
        target: the dotted name of the imported module.
        path: the importing file.
        line: the statement's line.
        where: ``"module"``, ``"function"`` (inside a def) or ``"TYPE_CHECKING"``.
    """

    target: str
    path: Path
    line: int
    where: str

    def describe(self, source: str) -> str:
        """``source -> target (file:line, where)``."""
        return f"{source} -> {self.target} ({self.path.name}:{self.line}, {self.where})"


def package_modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` (subpackages included), by dotted name.

    Args:
        package: a top-level (or sub-) package name, e.g. ``"cp_sharder"``; it is located,
            not imported.

    Raises:
        ValueError: ``package`` is not an installed package (a plain module or nothing).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{package!r} is not an importable package; install it or fix the name")
    modules: dict[str, Path] = {}
    for location in spec.submodule_search_locations:
        root = Path(location)
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module a ``from ... import`` names (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, path: Path, modules: Collection[str]
) -> Iterator[str]:
    """The modules of ``modules`` an import statement names.

    ``from pkg import sub`` names ``pkg.sub`` when that is a module, else (a name defined in
    ``pkg``) ``pkg`` itself.
    """
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = _resolve(module, node, path.name == "__init__.py")
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in modules else base


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement below ``tree`` with where it stands."""

    def walk(node: ast.AST, where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, where
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(child, "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "TYPE_CHECKING")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), where)
            else:
                yield from walk(child, where)

    yield from walk(tree, "module")


def import_graph(package: str) -> dict[str, list[ImportEdge]]:
    """Each module of ``package`` -> the imports of its own package's modules.

    A statement naming several modules gives one edge each; a module imported by several
    statements gives one edge per statement (each is a place to change).
    """
    modules = package_modules(package)
    graph: dict[str, list[ImportEdge]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: list[ImportEdge] = []
        for node, where in _imports(tree):
            seen: set[str] = set()
            for name in _targets(node, module, path, modules):
                if name in modules and name != module and name not in seen:
                    seen.add(name)
                    edges.append(ImportEdge(target=name, path=path, line=node.lineno, where=where))
        graph[module] = edges
    return graph


def find_cycles(graph: Mapping[str, list[ImportEdge]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module.

    Returns:
        Each cycle as ``[m0, m1, ..., m0]`` (m0 the component's first module by name), in
        the order of their first modules; empty when the graph is acyclic.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; packages are small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for edge in graph.get(v, []):
            w = edge.target
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted((_cycle_in(graph, c) for c in components), key=lambda c: c[0])


def _cycle_in(graph: Mapping[str, list[ImportEdge]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, inside it)."""
    members, start = set(component), component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for edge in graph.get(v, []):
                w = edge.target
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in members and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in the component {component}")


def assert_no_import_cycles(package: str) -> None:
    """``package``'s modules import each other without a cycle.

    Raises:
        AssertionError: naming each cycle with the file and line of every import in it, and
            where that import stands (module level, function-local, TYPE_CHECKING).
    """
    graph = import_graph(package)
    cycles = find_cycles(graph)
    if not cycles:
        return
    lines = [f"{len(cycles)} import cycle(s) inside {package}:"]
    for cycle in cycles:
        lines.append("  " + " -> ".join(cycle))
        for source, target in itertools.pairwise(cycle):
            edge = next(e for e in graph[source] if e.target == target)
            lines.append("    " + edge.describe(source))
    lines.append(
        "Move what both sides need into a module of its own that both import, or pass it in; "
        "a function-local or TYPE_CHECKING import hides a cycle, it does not break it."
    )
    raise AssertionError("\n".join(lines))
