"""The import graph, built from the source with every import counted, function-local ones included:
no circle between modules, and no package imports one above it in the data flow."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The data flow, lowest first: a package may import itself and those before it, never one after it.
LAYERS = ("conf", "perception", "sim_render", "adaptation", "policies", "benchmarks")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``module -> the project modules it imports`` (anywhere in the file: top, functions, ``TYPE_CHECKING``
    blocks aside)."""
    files = {_module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                for n in ast.walk(node)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                candidates = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for c in candidates:
                # The longest project module the import names (``from a.b import c``: a.b.c when c is a module).
                while c and c not in files:
                    c = c.rpartition(".")[0]
                if c and c != name:
                    targets.add(c)
                    break
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle_hidden_in_a_function():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_round_a_circle():
    found = circles(import_graph())
    assert found == [], "import circles (function-local imports counted): " + "; ".join(" <-> ".join(c) for c in found)


def test_no_package_imports_one_after_it_in_the_data_flow():
    rank = {layer: k for k, layer in enumerate(LAYERS)}
    upward = sorted(f"{a} -> {b}" for a, targets in import_graph().items() for b in targets
                    if rank[b.split(".")[0]] > rank[a.split(".")[0]])
    assert upward == []


def unannotated_local_imports() -> dict[str, list[int]]:
    """``file -> line numbers`` of the imports inside a function (``TYPE_CHECKING`` blocks aside) with no
    ``# lazy: <reason>`` on a line of the statement: an import stays in a function only for a stated reason."""
    found: dict[str, list[int]] = {}
    for path in sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tree = ast.parse(text, str(path))
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                for n in ast.walk(node)}
        bad = sorted({n.lineno for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                      for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skip
                      and not any(re.search(r"#\s*lazy:\s*\S", lines[k - 1]) for k in range(n.lineno, n.end_lineno + 1))})
        if bad:
            found[path.relative_to(ROOT).as_posix()] = bad
    return found


def test_every_function_local_import_states_its_reason():
    offenders = unannotated_local_imports()
    assert offenders == {}, "imports inside a function need '# lazy: <reason>' (or move them to the top): " + "; ".join(
        f"{f}:{','.join(map(str, lines))}" for f, lines in offenders.items())
