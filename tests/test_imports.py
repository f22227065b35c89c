"""Contract: miles_vl's modules import each other in one direction (issue 31): the graph of their module-level
imports has no cycle.

An edge A -> B is an `import B` or `from B import x` (B or B.x, whichever is a module of miles_vl) anywhere in A's
module body outside functions and classes, including the blocks under `if TYPE_CHECKING:`: a name a module needs
only for its annotations is still a dependency of the module (both cycles issue 31 found were of that kind).
Imports inside functions are not edges. Importing a submodule runs its package's `__init__` too, but that is not an
edge here: a package that re-exports its submodules would otherwise always form a cycle with them.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "miles_vl"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements of the module body and of the `if`/`try`/`with` blocks in it, not of functions or classes."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            todo += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            todo += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
    return found


def import_graph() -> dict[str, set[str]]:
    """miles_vl's modules -> the miles_vl modules each imports at module level."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # a relative import: `from .x import y` in package p is p.x
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names]
            edges |= {t for t in targets if t in paths and t != name}
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as `[a, b, ..., a]`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            visit(v)
    return [cycle_in(graph, set(c)) for c in components]


def cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within the component)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {sorted(component)}")


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "miles_vl.orchestration.loop" in graph and graph["miles_vl.orchestration.loop"]  # the graph was built
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among miles_vl's modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_a_cycle_is_found_and_named():
    """The check itself: a cycle through three modules, one of its edges a TYPE_CHECKING import, is reported whole."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x import y\ndef f():\n    import z\n"
    )
    assert [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in top_level_imports(tree)] == [
        "x",
        "typing",
    ]
