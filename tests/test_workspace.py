"""Cross-package checks of the workspace layout that ARCHITECTURE.md prescribes."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "deepinfer": "deepinfer",
    "deepinfer-sched": "deepinfer_sched",
    "deepinfer-model": "deepinfer_model",
    "deepinfer-parallel": "deepinfer_parallel",
    "deepinfer-spec": "deepinfer_spec",
    "deepinfer-structured": "deepinfer_structured",
    "deepinfer-cluster": "deepinfer_cluster",
    "deepinfer-eval": "deepinfer_eval",
    "deepinfer-tiny": "deepinfer_tiny",
}
# Allowed workspace dependencies: arrows point down docs/ARCHITECTURE.md's table only. Every package may
# read the environment-variable registry (deepinfer_cluster.envs).
ALLOWED = {
    "deepinfer-cluster": set(),
    "deepinfer-sched": {"deepinfer-cluster"},
    "deepinfer-structured": {"deepinfer-cluster"},
    "deepinfer-parallel": {"deepinfer-cluster"},
    "deepinfer-spec": {"deepinfer-cluster"},
    "deepinfer-model": {"deepinfer-sched", "deepinfer-parallel", "deepinfer-cluster", "deepinfer-spec"},
    "deepinfer-tiny": {"deepinfer-model", "deepinfer-cluster"},
    "deepinfer-eval": {"deepinfer", "deepinfer-cluster"},  # the engine only through the `generate` extra
    "deepinfer": set(PACKAGES) - {"deepinfer", "deepinfer-eval"},
}


def _project(name: str) -> dict:
    return tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]


def _requirement_names(reqs: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower() for r in reqs}


def test_every_package_has_its_parts():
    for name, import_name in PACKAGES.items():
        pkg = ROOT / "packages" / name
        project = _project(name)
        assert project["name"] == name
        assert project["requires-python"] == ">=3.11"
        assert (pkg / "README.md").read_text().strip(), f"{name}: empty README"
        assert (pkg / "src" / import_name / "__init__.py").is_file()
        assert any((pkg / "tests").glob("test_*.py")), f"{name}: no tests"


def test_workspace_dependencies_point_down_the_table():
    for name in PACKAGES:
        project = _project(name)
        reqs = set(_requirement_names(project.get("dependencies", [])))
        for extra in project.get("optional-dependencies", {}).values():
            reqs |= _requirement_names(extra)
        internal = {r for r in reqs if r in PACKAGES}
        assert internal <= ALLOWED[name], f"{name} depends on {internal - ALLOWED[name]}"


def test_eval_core_does_not_need_torch():
    reqs = _requirement_names(_project("deepinfer-eval")["dependencies"])
    assert "torch" not in reqs and "deepinfer" not in reqs


def test_root_is_a_virtual_workspace_with_all_members():
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert root["tool"]["uv"]["package"] is False
    assert root["tool"]["uv"]["workspace"]["members"] == ["packages/*"]
    assert set(root["tool"]["uv"]["sources"]) == set(PACKAGES)
    assert all(src == {"workspace": True} for src in root["tool"]["uv"]["sources"].values())
