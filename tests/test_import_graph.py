"""The import graph of every module under packages/*/src, read with `ast` (nothing is imported).

Three rules, each checked over module-level and function-local imports alike:
- no import cycle between the modules of one package, and none between packages;
- a package imports another only if its pyproject.toml declares it (a dependency or an extra);
- another package imports only a package itself (`from deepinfer_model import X`) or one of the
  submodules that the package lists in `__public_modules__` in its `__init__.py`; never a module or
  a name whose last part starts with `_`.
A package that exports lazily (a module-level `__getattr__`) imports the modules its `_MODULES` table
names, as an import statement spells them: each entry counts as an import of its `__init__`.

`python tests/test_import_graph.py` prints every violation, grouped by the importing package.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Package:
    dist: str  # the distribution name, as pyproject.toml and its dependencies spell it
    name: str  # the import name
    src: Path
    declared: frozenset[str]  # workspace distributions it depends on, extras included
    public_modules: frozenset[str]


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # dotted module name: a module of the workspace, or a name under one of its packages
    names: tuple[str, ...]  # names taken from `target` (`from target import names`); empty for `import`
    path: str  # relative to the workspace root
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].strip().lower()


def _public_modules(init: Path) -> frozenset[str]:
    for node in ast.parse(init.read_text(), str(init)).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__public_modules__" for t in node.targets
        ):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


def find_packages(root: Path = ROOT) -> dict[str, Package]:
    """The workspace's packages, by import name."""
    projects = {}
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
        (init,) = pyproject.parent.glob("src/*/__init__.py")
        projects[project["name"]] = (init.parent, {_requirement_name(r) for r in reqs})
    return {
        src.name: Package(
            dist=dist,
            name=src.name,
            src=src,
            declared=frozenset(reqs & projects.keys()),
            public_modules=_public_modules(src / "__init__.py"),
        )
        for dist, (src, reqs) in projects.items()
    }


def _module_files(packages: dict[str, Package]) -> dict[str, Path]:
    modules = {}
    for pkg in packages.values():
        for path in sorted(pkg.src.rglob("*.py")):
            parts = path.relative_to(pkg.src.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: -(level - 1)]
    return ".".join(base + ([name] if name else []))


def _exports_lazily(tree: ast.Module) -> bool:
    """A module-level `__getattr__`: defined there, or bound there (`deepinfer_cluster.lazy_exports`)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return True
        if isinstance(node, ast.Assign) and any(
            isinstance(n, ast.Name) and n.id == "__getattr__" for t in node.targets for n in ast.walk(t)
        ):
            return True
    return False


def _names_bound_by(module: str, tree: ast.Module, files: dict[str, Path]) -> set[str]:
    """Names a package's `__init__` binds to something other than its own submodule of that name:
    `from pkg import name` gets these from the package, as Python looks at attributes first. A package
    that exports lazily (a module-level `__getattr__`) binds the names it lists in tuples of strings."""
    bound = set()
    if _exports_lazily(tree):
        bound |= {
            element.value
            for literal in ast.walk(tree)
            if isinstance(literal, ast.Tuple)
            for element in literal.elts
            if isinstance(element, ast.Constant) and isinstance(element.value, str)
        }
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, True, node.level, node.module) if node.level else node.module
            for alias in node.names:
                if f"{base}.{alias.name}" != f"{module}.{alias.asname or alias.name}":
                    bound.add(alias.asname or alias.name)
    return bound


def read_imports(packages: dict[str, Package], root: Path = ROOT) -> list[Import]:
    """Every import of a workspace package by a workspace module."""
    files = _module_files(packages)
    trees = {module: ast.parse(path.read_text(), str(path)) for module, path in files.items()}
    bound = {
        m: _names_bound_by(m, trees[m], files) for m, path in files.items() if path.name == "__init__.py"
    }
    imports = []
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(trees[module]):
            if isinstance(node, ast.Import):
                found = [(alias.name, ()) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = _resolve_relative(module, is_package, node.level, node.module)
                found = []
                names = []
                for alias in node.names:
                    # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
                    if f"{base}.{alias.name}" in files and alias.name not in bound.get(base, ()):
                        found.append((f"{base}.{alias.name}", ()))
                    else:
                        names.append(alias.name)
                if names:
                    found.append((base, tuple(names)))
            else:
                continue
            for target, names in found:
                if target.split(".")[0] in packages:
                    imports.append(Import(module, target, names, str(path.relative_to(root)), node.lineno))
        if is_package:
            imports += _lazy_imports(module, trees[module], packages, str(path.relative_to(root)))
    return imports


def _lazy_imports(package: str, tree: ast.Module, packages: dict[str, Package], path: str) -> list[Import]:
    """The imports a package that exports lazily makes on first use: its `_MODULES` table maps each module,
    spelled as an import statement spells it (`.config`, `deepinfer_spec`), to the names taken from it."""
    if not _exports_lazily(tree):
        return []
    imports = []
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if not (
            isinstance(target, ast.Name) and target.id == "_MODULES" and isinstance(node.value, ast.Dict)
        ):
            continue
        for key, value in zip(node.value.keys, node.value.values, strict=True):
            spelled = ast.literal_eval(key)
            level = len(spelled) - len(spelled.lstrip("."))
            module = _resolve_relative(package, True, level, spelled[level:] or None) if level else spelled
            if module.split(".")[0] in packages:
                imports.append(Import(package, module, tuple(ast.literal_eval(value)), path, key.lineno))
    return imports


def package_of(module: str) -> str:
    return module.split(".")[0]


def strongly_connected(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The cycles of a directed graph: its strongly connected components of more than one node
    (or of one node importing itself). Iterative Tarjan, so deep graphs do not hit the recursion limit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    nodes = sorted(set(edges) | {n for targets in edges.values() for n in targets})
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges.get(node, ()):
                    components.append(frozenset(component))
    return components


def is_public(target: str, names: tuple[str, ...], pkg: Package) -> bool:
    """Whether another package may import `target` (and `names` from it)."""
    if any(name.startswith("_") for name in names):
        return False
    if target == pkg.name:
        return True
    return target.removeprefix(pkg.name + ".") in pkg.public_modules


@dataclass(frozen=True)
class Violations:
    private: list[Import]  # cross-package imports of a private module or name
    undeclared: list[Import]  # cross-package imports without a declared dependency
    module_cycles: dict[frozenset[str], list[Import]]  # modules of one package that import each other
    package_cycles: dict[frozenset[str], list[Import]]  # packages that import each other


def find_violations(root: Path = ROOT) -> Violations:
    packages = find_packages(root)
    imports = read_imports(packages, root)
    private, undeclared = [], []
    module_edges: dict[str, set[str]] = defaultdict(set)
    package_edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        src, dst = packages[package_of(imp.importer)], packages[package_of(imp.target)]
        if src is dst:
            module_edges[imp.importer].add(imp.target)
            continue
        package_edges[src.name].add(dst.name)
        if not is_public(imp.target, imp.names, dst):
            private.append(imp)
        if dst.dist not in src.declared:
            undeclared.append(imp)

    module_cycles = {
        cycle: [imp for imp in imports if imp.importer in cycle and imp.target in cycle]
        for cycle in strongly_connected(module_edges)
    }
    package_cycles = {
        cycle: [
            imp
            for imp in imports
            if package_of(imp.importer) in cycle
            and package_of(imp.target) in cycle
            and package_of(imp.importer) != package_of(imp.target)
        ]
        for cycle in strongly_connected(package_edges)
    }
    return Violations(private, undeclared, module_cycles, package_cycles)


def describe(violations: Violations) -> dict[str, list[str]]:
    """One line per violation, grouped by the importing package."""
    lines: dict[str, list[str]] = defaultdict(list)
    for imp in violations.private:
        names = f" import {', '.join(imp.names)}" if imp.names else ""
        lines[package_of(imp.importer)].append(f"private import: {imp.where()}: {imp.target}{names}")
    for imp in violations.undeclared:
        lines[package_of(imp.importer)].append(
            f"undeclared dependency: {imp.where()}: {imp.target} (add {package_of(imp.target)}'s "
            "distribution to pyproject.toml, or do not import it)"
        )
    for cycle, edges in violations.module_cycles.items():
        lines[package_of(next(iter(cycle)))].append(
            f"module cycle of {len(cycle)}: {', '.join(sorted(cycle))}\n"
            + "\n".join(f"      {imp.where()}: {imp.importer} -> {imp.target}" for imp in edges)
        )
    for cycle, edges in violations.package_cycles.items():
        for pkg in sorted(cycle):
            lines[pkg].append(
                f"package cycle: {' <-> '.join(sorted(cycle))}\n"
                + "\n".join(
                    f"      {imp.where()}: {imp.importer} -> {imp.target}"
                    for imp in edges
                    if package_of(imp.importer) == pkg
                )
            )
    return dict(sorted(lines.items()))


def _format(lines: list[str]) -> str:
    return "\n".join(f"  {line}" for line in lines)


@functools.cache
def _violations() -> Violations:
    return find_violations()


def test_no_cross_package_import_of_a_private_module():
    found = _violations().private
    assert not found, "import the package (or a module in its __public_modules__) instead:\n" + _format(
        [
            f"{imp.where()}: {imp.target}" + (f" import {', '.join(imp.names)}" if imp.names else "")
            for imp in found
        ]
    )


def test_every_cross_package_import_is_a_declared_dependency():
    found = _violations().undeclared
    assert not found, "imports of packages that pyproject.toml does not declare:\n" + _format(
        [f"{imp.where()}: {imp.target}" for imp in found]
    )


def test_no_import_cycle_between_packages():
    cycles = _violations().package_cycles
    assert not cycles, "packages that import each other:\n" + _format(
        [
            f"{' <-> '.join(sorted(cycle))}: "
            + "; ".join(f"{imp.where()} {imp.importer} -> {imp.target}" for imp in edges)
            for cycle, edges in cycles.items()
        ]
    )


def test_no_import_cycle_within_a_package():
    cycles = _violations().module_cycles
    assert not cycles, "modules that import each other:\n" + _format(
        [
            f"{', '.join(sorted(cycle))}:\n"
            + "\n".join(f"      {imp.where()}: {imp.importer} -> {imp.target}" for imp in edges)
            for cycle, edges in cycles.items()
        ]
    )


# Layering inside a package: (importer prefix, target prefix) pairs no import may join
FORBIDDEN_LAYERS = [
    # the paged runtime serves every model through its family (`deepinfer_model.family`), never a model
    ("deepinfer_model.runtime", "deepinfer_model.models"),
]


def test_no_import_across_a_forbidden_layer():
    imports = read_imports(find_packages())
    found = [
        f"{imp.where()}: {imp.importer} -> {imp.target}"
        for low, high in FORBIDDEN_LAYERS
        for imp in imports
        if (imp.importer == low or imp.importer.startswith(low + "."))
        and (imp.target == high or imp.target.startswith(high + "."))
    ]
    assert not found, "imports across a forbidden layer:\n" + _format(found)


def test_declared_public_modules_exist():
    for pkg in find_packages().values():
        for name in pkg.public_modules:
            path = pkg.src.joinpath(*name.split("."))
            assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), (
                f"{pkg.name}.__public_modules__ names {name!r}, which is not a module of {pkg.name}"
            )


def main() -> int:
    v = _violations()
    for pkg, lines in describe(v).items():
        print(f"{pkg}: {len(lines)}")
        print(_format(lines))
    print(
        f"private imports: {len(v.private)}, undeclared: {len(v.undeclared)}, "
        f"module cycles: {len(v.module_cycles)}, package cycles: {len(v.package_cycles)}"
    )
    return 1 if len(v.private) + len(v.undeclared) + len(v.module_cycles) + len(v.package_cycles) else 0


if __name__ == "__main__":
    sys.exit(main())


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _project(name: str, deps: list[str] = (), extras: dict[str, list[str]] | None = None) -> str:
    text = f'[project]\nname = "{name}"\ndependencies = {list(deps)!r}\n'.replace("'", '"')
    if extras:
        text += "[project.optional-dependencies]\n" + "".join(
            f"{k} = {v!r}\n".replace("'", '"') for k, v in extras.items()
        )
    return text


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    """A made-up workspace with one violation of each kind, and imports that must not count."""
    _write(
        tmp_path,
        {
            "packages/low/pyproject.toml": _project("low"),
            "packages/low/src/low/__init__.py": (
                "from .core import thing\nfrom . import util\n__public_modules__ = ('testing',)\n"
            ),
            "packages/low/src/low/core.py": "def thing(): pass\n",
            "packages/low/src/low/util.py": "def helper():\n    from .core import thing\n",
            "packages/low/src/low/_native.py": "",
            "packages/low/src/low/testing/__init__.py": "",
            "packages/low/src/low/a.py": "from . import b\n",
            "packages/low/src/low/b.py": "def late():\n    from low import a\n",
            # exports lazily: `shown` is the name its __getattr__ serves, `hidden` only a module
            "packages/lazy/pyproject.toml": _project("lazy"),
            "packages/lazy/src/lazy/__init__.py": (
                "_WHERE = {'shown': ('shown',)}\n\ndef __getattr__(name):\n    pass\n"
            ),
            "packages/lazy/src/lazy/shown.py": "def shown(): pass\n",
            "packages/lazy/src/lazy/hidden.py": "",
            "packages/mid/pyproject.toml": _project("mid", ["low>=0.1", "lazy"], {"extra": ["top"]}),
            "packages/mid/src/mid/__init__.py": (
                "import low\nfrom low import thing\nfrom low.testing import x\n"
                "def f():\n    import low.core\n    from low import util\n    from low import _hidden\n"
                "def g():\n    from top import run\n    from lazy import shown, hidden\n"
            ),
            "packages/top/pyproject.toml": _project("top", ["mid"]),
            "packages/top/src/top/__init__.py": "from mid import f\nimport low\n",
            "packages/top/src/top/sub/__init__.py": "",
            "packages/top/src/top/sub/mod.py": "from .. import sub\nfrom low._native import y\n",
        },
    )
    v = find_violations(tmp_path)
    assert sorted((i.importer, i.target, i.names, i.where()) for i in v.private) == [
        ("mid", "lazy.hidden", (), "packages/mid/src/mid/__init__.py:10"),
        ("mid", "low", ("_hidden",), "packages/mid/src/mid/__init__.py:7"),
        ("mid", "low.core", (), "packages/mid/src/mid/__init__.py:5"),
        ("mid", "low.util", (), "packages/mid/src/mid/__init__.py:6"),
        ("top.sub.mod", "low._native", ("y",), "packages/top/src/top/sub/mod.py:2"),
    ]
    assert [(i.importer, i.target) for i in v.undeclared] == [("top", "low"), ("top.sub.mod", "low._native")]
    assert list(v.module_cycles) == [frozenset({"low.a", "low.b"})]
    assert [(i.importer, i.target, i.line) for i in v.module_cycles[frozenset({"low.a", "low.b"})]] == [
        ("low.a", "low.b", 1),
        ("low.b", "low.a", 2),
    ]
    assert list(v.package_cycles) == [frozenset({"mid", "top"})]


def test_a_clean_workspace_has_no_violations(tmp_path):
    _write(
        tmp_path,
        {
            "packages/low/pyproject.toml": _project("low"),
            "packages/low/src/low/__init__.py": "from .core import thing\n",
            "packages/low/src/low/core.py": "import os\n\ndef thing():\n    from . import helpers\n",
            "packages/low/src/low/helpers.py": "import numpy\n",
            "packages/lazy/pyproject.toml": _project("lazy", ["low"]),
            "packages/lazy/src/lazy/__init__.py": (
                "_WHERE = {'helper': ('helper',)}\n\ndef __getattr__(name):\n    pass\n"
            ),
            "packages/lazy/src/lazy/helper.py": "",
            "packages/top/pyproject.toml": _project("top", ["low", "lazy"]),
            "packages/top/src/top/__init__.py": "import low\nfrom low import thing\nfrom lazy import helper\n",
        },
    )
    v = find_violations(tmp_path)
    assert (v.private, v.undeclared, v.module_cycles, v.package_cycles) == ([], [], {}, {})


@pytest.mark.parametrize(
    "getattr_source",
    [
        "def __getattr__(name):\n    pass\n",
        "__getattr__, __dir__, __all__ = lazy_exports(__name__, globals(), _MODULES)\n",
    ],
    ids=["defined", "from-lazy_exports"],
)
def test_a_lazy_export_table_counts_as_imports(tmp_path, getattr_source):
    """The modules a package's `_MODULES` table names (imported by its `__getattr__` on first use, defined
    in the `__init__` or bound there by `deepinfer_cluster.lazy_exports`) are edges like any import: a
    cycle through the table and an undeclared package in it are found."""
    _write(
        tmp_path,
        {
            "packages/base/pyproject.toml": _project("base"),
            "packages/base/src/base/__init__.py": "",
            "packages/lazy/pyproject.toml": _project("lazy"),
            "packages/lazy/src/lazy/__init__.py": (
                "_MODULES: dict = {\n    '.core': ('thing',),\n    'base': ('x',),\n}\n\n" + getattr_source
            ),
            "packages/lazy/src/lazy/core.py": "def thing():\n    from lazy import other\n",
        },
    )
    v = find_violations(tmp_path)
    assert [(i.importer, i.target, i.names, i.line) for i in v.undeclared] == [("lazy", "base", ("x",), 3)]
    assert list(v.module_cycles) == [frozenset({"lazy", "lazy.core"})]
    assert [(i.importer, i.target, i.line) for i in v.module_cycles[frozenset({"lazy", "lazy.core"})]] == [
        ("lazy", "lazy.core", 2),
        ("lazy.core", "lazy", 2),
    ]
