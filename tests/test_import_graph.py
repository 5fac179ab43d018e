"""The source tree's shape: no import circles, among modules or among folders, and no folder
too crowded to read.

The graph is read from the source with :mod:`ast`, not by importing it: every ``import`` counts,
at module level, inside functions and under ``TYPE_CHECKING``, since each one is an arrow a
reader has to follow.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "encdisagg"
PACKAGE = SRC.name

#: Most ``.py`` files a folder under the package may hold.
MOST_FILES = 15


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(SRC).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def _arrows(node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path]) -> set[str]:
    """The project modules one import statement in *module* reaches."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level == 0:
        base = node.module or ""
    else:
        # A package's own name is its anchor for ``from . import``; a module's is its parent.
        anchor = module.split(".")
        if modules[module].name != "__init__.py":
            anchor.pop()
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, *([node.module] if node.module else [])])
    # ``from pkg import name`` reaches the submodule ``pkg.name`` where there is one, else a
    # name defined (or loaded) by ``pkg`` itself.
    submodules = {f"{base}.{alias.name}" for alias in node.names} & set(modules)
    if base in modules and len(submodules) < len(node.names):
        submodules.add(base)
    return submodules


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        arrows: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                arrows |= _arrows(node, module, modules)
        graph[module] = arrows - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = _graph()
    # ``from ._errors import ...`` at the top of the package's own __init__.
    assert "encdisagg._errors" in graph["encdisagg"]
    # ``from .. import _tracing``: the submodule, not the package.
    assert "encdisagg._tracing" in graph["encdisagg.server._dp._calls"]
    # Inside a function (``encdisagg receive --from`` loads its fetch late).
    assert "encdisagg._cli._receive_staged" in graph["encdisagg._cli._receive"]
    # Under ``TYPE_CHECKING``.
    assert (
        "encdisagg.server._sglang._grpc_service" in graph["encdisagg.server._sglang._grpc_beside"]
    )


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _circles(graph) == [("a", "b", "c")]


def test_no_import_circle() -> None:
    circles = _circles(_graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def _prefix(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth])


def _collapsed(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """``graph`` with each module named by its first ``depth`` dotted parts: a folder that deep
    stands for everything beneath it."""
    collapsed: dict[str, set[str]] = {}
    for module, arrows in graph.items():
        node = _prefix(module, depth)
        targets = {_prefix(arrow, depth) for arrow in arrows}
        collapsed.setdefault(node, set()).update(targets - {node})
    return collapsed


def _folder_circles(graph: dict[str, set[str]]) -> dict[tuple[str, ...], list[str]]:
    """Each circle among folders, at every depth, with the module arrows that close it.

    A circle of plain modules, no folder among them, is :func:`test_no_import_circle`'s.
    """
    folders = {module.rpartition(".")[0] for module in graph}
    found: dict[tuple[str, ...], list[str]] = {}
    for depth in range(2, max(module.count(".") for module in graph) + 2):
        for circle in _circles(_collapsed(graph, depth)):
            if folders.isdisjoint(circle):
                continue
            found[circle] = [
                f"{module} -> {arrow}"
                for module, arrows in sorted(graph.items())
                for arrow in sorted(arrows)
                if _prefix(module, depth) in circle
                and _prefix(arrow, depth) in set(circle) - {_prefix(module, depth)}
            ]
    return found


def test_folder_circles_are_found() -> None:
    graph = {
        "p.a.x": {"p.b.y"},
        "p.b.y": set(),
        "p.b.z": {"p.a.w"},
        "p.a.w": set(),
        "p.c": {"p.a.x"},
        # Two plain modules in a circle: the module rule's, not this one's.
        "p.d": {"p.e"},
        "p.e": {"p.d"},
    }
    assert _folder_circles(graph) == {("p.a", "p.b"): ["p.a.x -> p.b.y", "p.b.z -> p.a.w"]}


def test_no_circle_among_folders() -> None:
    circles = _folder_circles(_graph())
    closed = [f"{' <-> '.join(c)} ({', '.join(arrows)})" for c, arrows in sorted(circles.items())]
    assert not closed, "circles among folders, closed by: " + "; ".join(closed)


def test_no_folder_is_crowded() -> None:
    counts = Counter(path.parent.relative_to(SRC).as_posix() for path in SRC.rglob("*.py"))
    crowded = {folder: count for folder, count in counts.items() if count > MOST_FILES}
    assert not crowded, f"folders over {MOST_FILES} files: {crowded}"
