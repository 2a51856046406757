"""The engine benchmarks' output: a plain table of the records on stdout, then the records as JSON."""

from __future__ import annotations

import json
from pathlib import Path


def print_and_write(records: list[dict], cols: list[tuple[str, str]], path: Path) -> None:
    """`cols`: (record key, format of its value); a missing value prints as "-"."""
    print(" | ".join(c for c, _ in cols))
    for r in records:
        print(" | ".join(fmt.format(r[c]) if r[c] is not None else "-" for c, fmt in cols))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {path}")
