"""Import structure of k3: no cycle between its packages and a model free of torch.distributed.

Every module's source is parsed (nothing is imported), so imports inside functions count as much as
top-level ones. A node of the graph is a package or top-level module of k3 (`k3.model`, `k3.config`,
...); an edge A -> B means some module of A imports something of B.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import k3

ROOT = Path(k3.__file__).parent


def _module_name(path: Path) -> tuple[str, bool]:
    """k3/serve/engine.py -> ("k3.serve.engine", False); k3/serve/__init__.py -> ("k3.serve", True)."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """(absolute imported module name, line) of every import statement in `path`, nested ones too.
    `from X import y` yields X.y as well as X (y may be a submodule)."""
    name, is_pkg = _module_name(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, node.lineno
            for a in node.names:
                yield f"{mod}.{a.name}", node.lineno


def _node(module: str) -> str | None:
    """The package-level node of a k3 module name (None for k3 itself and for other libraries)."""
    parts = module.split(".")
    if parts[0] != "k3" or len(parts) < 2:
        return None
    top = parts[1]
    if (ROOT / top).is_dir() or (ROOT / f"{top}.py").is_file():
        return f"k3.{top}"
    return None  # `from k3 import name` of a non-module attribute


def package_graph() -> dict[str, dict[str, str]]:
    """{node: {imported node: "file:line" of one such import}} over every module of k3."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        src = _node(_module_name(path)[0])
        if src is None:  # k3/__init__.py, k3/__main__.py: the entry points, not a layer
            continue
        graph.setdefault(src, {})
        for mod, line in _imports(path):
            dst = _node(mod)
            if dst is not None and dst != src:
                graph[src].setdefault(dst, f"{path.relative_to(ROOT.parent)}:{line}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the graph, or None when it is acyclic (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, {}))))
    return None


def test_find_cycle_reports_one() -> None:
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {}}) is None
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}}) == ["a", "b", "c", "a"]


def test_graph_sees_the_packages() -> None:
    graph = package_graph()
    assert "k3.model" in graph and "k3.ops" in graph["k3.model"]
    assert set(graph) >= {"k3.config", "k3.ops", "k3.model", "k3.chat", "k3.data", "k3.serve", "k3.cli"}


def test_no_import_cycle_between_packages() -> None:
    graph = package_graph()
    cycle = find_cycle(graph)
    if cycle is not None:
        where = "\n".join(f"  {a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:]))
        raise AssertionError(f"import cycle between k3 packages:\n{where}")


def test_model_does_not_import_torch_distributed() -> None:
    bad = [f"{p.relative_to(ROOT.parent)}:{line}: {mod}"
           for p in sorted((ROOT / "model").rglob("*.py")) for mod, line in _imports(p)
           if mod == "torch.distributed" or mod.startswith("torch.distributed.")]
    assert not bad, "k3/model is single-device code; it imports torch.distributed at\n" + "\n".join(bad)
