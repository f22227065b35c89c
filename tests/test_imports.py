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


# ---------------------------------------------------------------------------------------------------------------------
# the engine seam: what must not import an engine

THIRD_PARTY_ENGINES = ("sglang", "vllm")


def engine_packages() -> set[str]:
    """miles_vl's rollout engines: the packages under miles_vl/rollout/ (one folder per engine)."""
    rollout = PACKAGE / "rollout"
    return {f"miles_vl.rollout.{d.name}" for d in rollout.iterdir() if (d / "__init__.py").is_file()}


def imports_anywhere(path: Path, name: str) -> set[str]:
    """Every module an import statement of the file names, at module level or inside functions: `import a.b` -> a.b,
    `from a import b` -> a and a.b (b may be a module), relative imports made absolute."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def engine_imports(module: str) -> list[str]:
    """The engine modules `module` imports: its own imports anywhere, and those of every miles_vl module it reaches
    through module-level imports."""
    graph = import_graph()
    reached, todo = {module}, [module]
    while todo:
        for w in graph[todo.pop()] - reached:
            reached.add(w)
            todo.append(w)
    named = set()
    for m in reached:
        parts = m.split(".")
        path = PACKAGE.parent.joinpath(*parts)
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        named |= {f"{m}: {i}" for i in imports_anywhere(path, m)}
    engines = (*sorted(engine_packages()), *THIRD_PARTY_ENGINES)
    return sorted(
        n for n in named if any(n.split(": ")[1] == e or n.split(": ")[1].startswith(e + ".") for e in engines)
    )


def test_weight_sync_imports_no_engine():
    """Issue 31.3: the engine-agnostic weight sync (buckets, deadlines, the two strategies) imports no engine, not
    even inside a function; each engine's wire lives in its folder (rollout/sglang/weights.py) and reaches the
    strategies through the engine table (orchestration/factories.py), so a new engine changes nothing there."""
    assert {"miles_vl.rollout.hf", "miles_vl.rollout.sglang"} <= engine_packages()  # the check sees the engines
    assert engine_imports("miles_vl.rollout.weight_sync") == []


def test_placement_imports_no_engine():
    """Issue 31.3: Ray placement reads the job's GPU environment from the leaf `miles_vl.gpu_env`, not from the sglang
    package (which it used to import for NVLink's multicast settings)."""
    assert engine_imports("miles_vl.orchestration.placement") == []


def test_engine_imports_are_found():
    """The check itself: the sglang host imports its engine's modules and SGLang-adjacent ones, and is reported."""
    found = engine_imports("miles_vl.rollout.sglang.host")
    assert "miles_vl.rollout.sglang.host: miles_vl.rollout.sglang.weights" in found


def test_an_actors_module_leaves_the_drivers_stack_out():
    """A Ray actor imports its own module (a train rank `miles_vl.orchestration.trainer`, an engine
    `miles_vl.rollout.hf.engine`) in a fresh process at every job start: neither pulls in the driver loop or the
    plots (matplotlib), which `miles_vl.orchestration` and `miles_vl.metrics` import on first use."""
    import subprocess
    import sys

    probe = (
        "import sys, miles_vl.orchestration.trainer, miles_vl.rollout.hf.engine; "
        "print(sorted(m for m in ('miles_vl.orchestration.loop', 'miles_vl.metrics.plots', 'matplotlib') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
