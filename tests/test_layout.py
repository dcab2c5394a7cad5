"""The layout's hard limits, checked on the source: no import cycle in the package (function-local imports counted),
no private name imported across modules (sieve, tests, scripts), no path arithmetic to the shared data, no function
above 80 lines without its reason stated, and scripts/ holding only maintained tools (a docstring and a main())."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sieve"
MAX_LINES = 80


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(name: str, path: Path, node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The package modules an import statement loads (the longest known module of each name it names)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for n in names:
        while n and n not in known:
            n = n.rpartition(".")[0]
        if n and n != name and not name.startswith(n + "."):  # a package's own __init__ is not an edge
            out.append(n)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {m: set() for m in known}
    for m, p in known.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[m].update(imported(m, p, node, known))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk found the package and its imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_private_name_is_imported_across_modules():
    bad = []
    for folder in ("sieve", "tests", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and ((node.module or "").startswith("sieve") or node.level):
                    bad += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def test_the_shared_data_is_found_in_one_place():
    bad = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
           if "parents[" in p.read_text() and p.name != "data.py"]
    assert not bad, f"find ../shared/data with sieve.data.shared_data, not path arithmetic: {bad}"


def test_no_function_is_long_without_a_reason():
    """A function over 80 lines says why in its docstring ("Long because ...")."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES and "Long because" not in (ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_scripts_are_maintained_tools():
    for path in sorted((ROOT / "scripts").glob("*.py")):
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{path.name} says what it is for"
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), f"{path.name} has a main()"
