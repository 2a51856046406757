"""Every DEEPINFER_* variable the code names is declared once, in `deepinfer_cluster.envs`, and the engine
README's table says what the registry says.

The scan reads every Python file of packages/*/src, benchmarks/ and eval/: each DEEPINFER_ name in its text
(code, strings, comments) must be declared, and no name may be built at run time (an f-string or a
concatenation ending in the prefix), since such a name could not be checked. Direct reads of the process
environment for a DEEPINFER_ name (`os.environ.get`, `os.getenv`, `os.environ[...]`) outside the registry
are allowed only in the files listed below (benchmarks may set variables for the code they run and restore
the raw values they saved; what they read as a setting they read through the registry too).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from deepinfer_cluster import envs

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "packages/deepinfer-cluster/src/deepinfer_cluster/envs.py"
README = ROOT / "packages/deepinfer/README.md"
NAME = re.compile(r"DEEPINFER_[A-Z0-9_]*[A-Z0-9]")
# Files that save a variable's raw value to restore it after setting it (not a read of the setting)
SAVE_AND_RESTORE = {
    "packages/deepinfer/src/deepinfer/reproducibility/ppl.py",
    "benchmarks/gpu/check_model_on_gpu.py",
    "benchmarks/gpu/profile_prefill_step.py",
}


def _sources() -> list[Path]:
    roots = [*sorted((ROOT / "packages").glob("*/src")), ROOT / "benchmarks", ROOT / "eval"]
    return [p for r in roots if r.exists() for p in sorted(r.rglob("*.py")) if ".venv" not in p.parts]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _direct_reads(tree: ast.AST) -> list[str]:
    """DEEPINFER_ names read from the process environment by literal: os.environ.get / os.getenv / [...]."""
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and _is_environ(f.value)) or f.attr == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        if (
            isinstance(key, ast.Constant)
            and isinstance(key.value, str)
            and key.value.startswith("DEEPINFER_")
        ):
            found.append(key.value)
    return found


def _built_names(tree: ast.AST) -> list[int]:
    """Lines where a name is built from the prefix at run time (f"DEEPINFER_{x}", "DEEPINFER_" + x)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for part, after in zip(node.values, node.values[1:], strict=False):
                if isinstance(part, ast.Constant) and re.search(r"DEEPINFER_[A-Z0-9_]*$", str(part.value)):
                    if isinstance(after, ast.FormattedValue):
                        lines.append(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = node.left
            if isinstance(left, ast.Constant) and re.search(r"DEEPINFER_[A-Z0-9_]*$", str(left.value)):
                lines.append(node.lineno)
    return lines


def test_every_named_variable_is_declared():
    undeclared, built, direct = [], [], []
    files = _sources()
    assert len(files) > 100  # the scan sees the tree
    for path in files:
        text = path.read_text(encoding="utf-8")
        if "DEEPINFER_" not in text:
            continue
        rel = _rel(path)
        undeclared += [f"{rel}: {n}" for n in sorted(set(NAME.findall(text))) if n not in envs.VARS]
        if path == REGISTRY:
            continue
        tree = ast.parse(text, filename=rel)
        built += [f"{rel}:{line}" for line in _built_names(tree)]
        if rel not in SAVE_AND_RESTORE:
            direct += [f"{rel}: {n}" for n in _direct_reads(tree)]
    assert not undeclared, f"declare these in deepinfer_cluster/envs.py: {undeclared}"
    assert not built, f"names built at run time cannot be checked; spell them out: {built}"
    assert not direct, f"read these through deepinfer_cluster.envs: {direct}"


def test_the_scan_catches_what_it_looks_for():
    tree = ast.parse(
        'import os\nos.environ.get("DEEPINFER_X")\nos.getenv("DEEPINFER_Y")\nos.environ["DEEPINFER_Z"]\n'
        'os.environ["DEEPINFER_W"] = "1"\nf"DEEPINFER_{k}"\n"DEEPINFER_" + k\n'
    )
    assert _direct_reads(tree) == ["DEEPINFER_X", "DEEPINFER_Y", "DEEPINFER_Z"]
    assert _built_names(tree) == [6, 7]
    assert NAME.findall("see DEEPINFER_FOO_BAR, not DEEPINFER_* or DEEPINFER_{DP,CP}") == [
        "DEEPINFER_FOO_BAR"
    ]


def _readme_rows() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `(DEEPINFER_[A-Z0-9_]+)` \| ([^|]*) \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} listed twice"
            rows[m.group(1)] = m.group(2).strip()
    return rows


def test_readme_table_matches_the_registry():
    """One row per declared variable, with the registry's default (`python -m deepinfer_cluster.envs` prints
    the table)."""
    rows = _readme_rows()
    assert set(rows) == set(envs.VARS), (
        sorted(set(rows) - set(envs.VARS)),
        sorted(set(envs.VARS) - set(rows)),
    )
    wrong = {n: (d, envs.VARS[n].default_text) for n, d in rows.items() if d != envs.VARS[n].default_text}
    assert not wrong, f"README default vs registry: {wrong}"


def test_readme_table_is_the_generated_one():
    """The whole table, meanings included, is what `python -m deepinfer_cluster.envs` prints."""
    section = README.read_text(encoding="utf-8").split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    assert envs.markdown_table() in section, "regenerate it: python -m deepinfer_cluster.envs"


def test_compile_backends_are_the_runtimes():
    from deepinfer_model.runtime.compiled import BACKENDS

    assert envs.COMPILE_BACKENDS == BACKENDS


def test_values_are_read_when_accessed_and_bad_ones_name_the_choices(monkeypatch):
    monkeypatch.delenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", raising=False)
    assert envs.DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS == 32  # the code's default, not the reference's 0
    monkeypatch.setenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "4")
    assert envs.DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS == 4
    monkeypatch.setenv("DEEPINFER_TILELANG", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_TILELANG must be one of 0, 1, all, got 'maybe'"):
        _ = envs.DEEPINFER_TILELANG
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "off")
    assert envs.DEEPINFER_BATCH_INVARIANT is False
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "sure")
    with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT must be 1 / true / yes / on or 0"):
        _ = envs.DEEPINFER_BATCH_INVARIANT
    assert envs.get("DEEPINFER_USE_NEXTN_DECODE", {"DEEPINFER_USE_NEXTN_DECODE": "3"}) == 3
    with pytest.raises(ValueError, match=r"DEEPINFER_USE_NEXTN_DECODE must be an integer in \[0, 32\]"):
        envs.get("DEEPINFER_USE_NEXTN_DECODE", {"DEEPINFER_USE_NEXTN_DECODE": "33"})


def test_the_registry_imports_nothing_heavy():
    import subprocess
    import sys

    code = "import sys, deepinfer_cluster.envs; print(sorted(m for m in ('torch', 'psutil', 'numpy') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
