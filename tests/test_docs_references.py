"""The repository's Markdown points only at what the repository holds: no sections of specifications
that live elsewhere (`§`, `engine.md`, `v41-model`), no `shared/` folder outside it, and every relative
link resolves. What users and contributors need from the reference is in docs/REFERENCE.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"§|\bengine\.md\b|\bv41-model\b|(?:\.\./)+shared/|\bshared/(?:spec|ARCHITECTURE)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _markdown() -> list[Path]:
    """The repository's Markdown: what git tracks or would add (local scratch that .gitignore keeps
    out is not the repository's), else every file outside the tool folders."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", ".git", "node_modules", ".gpu"}
        return sorted(p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts))
    return sorted(ROOT / name for name in listed if (ROOT / name).is_file())


def test_no_pointers_to_documents_outside_the_repository():
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for p in _markdown()
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_relative_links_resolve():
    broken = []
    for p in _markdown():
        for target in LINK.findall(p.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (p.parent / target).exists():
                broken.append(f"{p.relative_to(ROOT)} -> {target}")
    assert not broken, "\n".join(broken)


def test_the_scan_catches_what_it_looks_for():
    for bad in ("see engine.md §5.4", "../shared/ARCHITECTURE.md", "spec v41-model 4.9", "shared/spec/x"):
        assert OUTSIDE.search(bad), bad
    assert not OUTSIDE.search("the deepinfer-spec package shares its stream")
