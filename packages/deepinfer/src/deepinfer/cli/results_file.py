"""The --output JSONL of `deepinfer generate`: checked before the model loads, appended to (and flushed)
as each request finishes, and read back to resume a run that was stopped."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import CliError


class ResultsFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        check_output_path(path)
        self.done = finished_keys(path) if path.exists() else set()
        try:  # opened now: an unwritable path fails here, before anything is loaded
            self._file = path.open("a", encoding="utf-8")
        except OSError as e:
            raise CliError(f"--output {path}: cannot write to it ({e.strerror or e})") from None
        if self._file.tell() and not _ends_with_newline(path):
            self._file.write("\n")  # a line cut off by a kill: the next record starts on its own line

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()  # in the OS's hands now: a Ctrl-C or a kill does not lose it

    def close(self) -> None:
        self._file.close()


def check_output_path(path: Path) -> None:
    """Refuse a path that cannot take the results, before anything is loaded or created."""
    if path.is_dir():
        raise CliError(f"--output {path}: is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"--output {path}: directory {parent} does not exist")
    target = path if path.exists() else parent
    if not os.access(target, os.W_OK):
        raise CliError(f"--output {path}: {'file' if target == path else 'directory'} is not writable")


def finished_keys(path: Path) -> set[tuple[str, object]]:
    """Resume keys of the requests `path` already holds a result for (records with an error, and lines
    that are not complete records, do not count: those requests run again)."""
    keys = set()
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or record.get("error") is not None or "outputs" not in record:
            continue
        if "id" in record:
            keys.add(("id", record["id"]))
        elif isinstance(record.get("index"), int):
            keys.add(("index", record["index"]))
    return keys


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
