"""Small parsers shared by the probes: kernel cpu lists and sysfs reads."""

from __future__ import annotations

from pathlib import Path


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Parse the kernel's list format ("0-3,8,10-11") into sorted ids."""
    ids: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            if int(hi) < int(lo):
                raise ValueError(f"cpu list range {part!r} is reversed")
            ids.update(range(int(lo), int(hi) + 1))
        else:
            ids.add(int(part))
    return tuple(sorted(ids))


def format_cpu_list(ids) -> str:
    """Inverse of parse_cpu_list, compressing runs ("0-3,8")."""
    ids = sorted(set(ids))
    runs: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        runs.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(runs)


def read_text(path: Path) -> str | None:
    """A sysfs / procfs file's content, or None when it is absent or unreadable."""
    try:
        return path.read_text()
    except OSError:
        return None
