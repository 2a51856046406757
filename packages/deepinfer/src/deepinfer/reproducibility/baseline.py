"""The decode-perplexity baseline file: `{platform: {workload: record}}` as JSON, updated under a lock.

Several processes (pytest workers, several nodes sharing one checkout) may refresh baselines at once.
Each writer takes `<file>.lock`, re-reads the file, merges in only its own platform's entries, writes a
temporary file next to the target and `os.replace`s it in. So a writer never overwrites entries it
did not produce (read-modify-write under the lock) and a reader never sees a half-written file (the
rename is atomic on POSIX filesystems).

The lock is `filelock.FileLock` (`fcntl.flock`); on Linux NFS clients `flock` is implemented with
NFS byte-range locks, so it excludes writers on other nodes too. Filesystems without working
`flock` (some FUSE mounts, Lustre without `-o flock`) can use `lock="soft"`: an O_EXCL lock file
(`filelock.SoftFileLock`), which works wherever exclusive create is atomic but is left behind if its
holder is killed (delete it by hand then).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from filelock import FileLock, SoftFileLock

LOCK_KINDS = ("flock", "soft")


class BaselineFile:
    def __init__(self, path: str | os.PathLike, lock: str = "flock", timeout_s: float = 300.0) -> None:
        if lock not in LOCK_KINDS:
            raise ValueError(f"lock must be one of {LOCK_KINDS}, got {lock!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.path = Path(path)
        # Distinct lock paths: an flock lock file may stay on disk, which a soft lock would read as held.
        # All writers of one file must use the same kind.
        if lock == "flock":
            self._lock = FileLock(str(self.path) + ".lock", timeout=timeout_s)
        else:
            self._lock = SoftFileLock(str(self.path) + ".softlock", timeout=timeout_s)

    def read(self) -> dict[str, dict[str, Any]]:
        """All platforms' entries ({} when the file does not exist yet)."""
        if not self.path.exists():
            return {}
        data = json.loads(self.path.read_text())
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise ValueError(f"{self.path}: expected {{platform: {{workload: record}}}}")
        return data

    def entry(self, platform: str, workload: str) -> dict[str, Any] | None:
        return self.read().get(platform, {}).get(workload)

    def update(self, platform: str, entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Replace `platform`'s records of the workloads in `entries`, keep everything else; returns
        the file's new content."""
        if not platform:
            raise ValueError("platform must be a non-empty string")
        with self._lock:
            data = self.read()
            data.setdefault(platform, {}).update(entries)
            data = {p: dict(sorted(w.items())) for p, w in sorted(data.items())}
            self._write_atomically(json.dumps(data, indent=1) + "\n")
        return data

    def _write_atomically(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())  # the data must be on disk before the rename makes it visible
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
