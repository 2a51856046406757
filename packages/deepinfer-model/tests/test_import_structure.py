"""The model package's import structure: no import cycle among its modules, and a runtime that imports
no model (it asks the model's family, `deepinfer_model.family`). Function-local imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import deepinfer_model

ROOT = Path(deepinfer_model.__file__).parent
PKG = "deepinfer_model"


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = [PKG, *f.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of the package `name` imports anywhere in its file (its parent packages excepted: they
    run before it whatever it imports)."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    deps = set()
    for m in found:
        while m and m not in mods:
            m = m.rpartition(".")[0]
        if m and m != name and not name.startswith(m + "."):
            deps.add(m)
    return deps


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
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
                    out.append(sorted(comp))
    return out


def test_no_import_cycle_in_the_model_package():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_runtime_imports_no_model():
    reach = sorted(
        f"{m} -> {d}"
        for m, deps in _graph().items()
        if m.startswith(f"{PKG}.runtime")
        for d in deps
        if d.startswith(f"{PKG}.models")
    )
    assert reach == []
