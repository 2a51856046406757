"""The KV cache tier below the device prefix cache: bounded host memory, and below it a bounded directory.

An entry is one block's `BlockPayload` (every pool's rows of the block), keyed by the scheduler's
`(hash, check)` pair: the chained prefix hash, salted by the request's cache salt, and a second chain
over the same prefix. Its metadata repeats the key and the block's tokens, which a load verifies against
the request; a file's checksums are verified when it is read.

Host entries live in an LRU; when the host budget is full the least recently used entry moves to disk (if
there is a disk tier and it is not there already), and disk files are deleted least recently used first.
An entry may be in both tiers (a disk hit is promoted to host and its file kept). `store` and `discard`
return the keys that left the tier altogether: the engine tells the scheduler they are no longer
loadable. Disk files are `<dir>/<fingerprint>/<hash>-<check>.kv`: engines of one model and settings
(the fingerprint) share them, and an engine starting on a directory finds what an earlier one left.

Engines running at the same time may share a directory: each writes a file under a name of its own
(`.tmp<pid>`) and renames it into place, `refresh()` (every `RESCAN_S` seconds, before a schedule) picks
up the files the others wrote and forgets those they deleted, and each keeps the directory within its
budget by deleting the oldest files, its own or not. A file deleted between a schedule and its load
makes that load fail, and the engine recomputes those blocks (tier_transfers.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer_model import BlockPayload

logger = logging.getLogger("deepinfer")

Key = tuple[int, int]  # (hash, check), each an unsigned 64-bit integer
SUFFIX = ".kv"
RESCAN_S = 5.0  # how often a disk tier looks for files that engines sharing its directory wrote or deleted
STALE_TMP_S = 3600.0  # a writer's temporary file this old is left over from a crash, whoever wrote it


@dataclass(frozen=True)
class TierSettings:
    host_bytes: int = 0
    disk_bytes: int = 0
    disk_dir: str | None = None

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0


@dataclass
class TierStats:
    host_hits: int = 0  # blocks loaded from host memory
    disk_hits: int = 0  # blocks loaded from disk
    stored: int = 0  # evicted blocks copied into the tier
    already_held: int = 0  # evicted blocks the tier held already (no copy)
    demoted: int = 0  # host entries written to disk
    dropped: int = 0  # entries that left the tier altogether
    failed_loads: int = 0
    store_s: float = 0.0  # reading evicted blocks out of the pools and storing them
    load_s: float = 0.0  # fetching entries and writing them into the pools
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


def key_name(key: Key) -> str:
    return f"{key[0]:016x}-{key[1]:016x}"


class KVTier:
    """Host LRU over an optional disk LRU (see the module docstring); `fingerprint` names what produced
    the entries (model, dtype, layout), so a shared directory never mixes engines that differ."""

    def __init__(self, settings: TierSettings, fingerprint: str, pin_memory: bool = False) -> None:
        if not settings.enabled:
            raise ValueError("a KV tier needs host_bytes > 0 or disk_bytes > 0")
        self.settings = settings
        self.fingerprint = fingerprint
        self.pin_memory = pin_memory
        self.stats = TierStats()
        self._host: OrderedDict[Key, BlockPayload] = OrderedDict()
        self._host_bytes = 0
        self._disk: OrderedDict[Key, int] = OrderedDict()  # key -> file size
        self._disk_bytes = 0
        self.dir: Path | None = None
        self._scanned_at = 0.0
        if settings.disk_bytes > 0:
            self.dir = Path(settings.disk_dir) / fingerprint
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()

    # -- what it holds -----------------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self._host or key in self._disk

    def keys(self) -> list[Key]:
        return list(dict.fromkeys([*self._host, *self._disk]))

    @property
    def host_bytes(self) -> int:
        return self._host_bytes

    @property
    def disk_bytes(self) -> int:
        return self._disk_bytes

    def touch(self, key: Key) -> None:
        """`key` was just used (an evicted block the tier already holds): most recently used."""
        if key in self._host:
            self._host.move_to_end(key)
        if key in self._disk:
            self._used(key)

    # -- in and out --------------------------------------------------------------------------------------
    def fetch(self, key: Key) -> tuple[BlockPayload, str]:
        """The entry under `key` and the tier it came from ("host" or "disk"). KeyError when absent;
        `PayloadError` when its file is corrupt (the file is then deleted)."""
        payload = self._host.get(key)
        if payload is not None:
            self._host.move_to_end(key)
            return payload, "host"
        if key not in self._disk:
            raise KeyError(key)
        path = self._path(key)
        try:
            payload = BlockPayload.load(path)
        except (OSError, ValueError):
            self._forget_file(key)
            raise
        self._used(key)
        if self.settings.host_bytes > 0:
            self._put_host(key, payload)
        return payload, "disk"

    def store(self, key: Key, payload: BlockPayload) -> list[Key]:
        """Keep `payload` under `key`; returns the keys that left the tier to make room."""
        if key in self:
            self.touch(key)
            return []
        if self.pin_memory:
            payload = BlockPayload(
                payload.block_size, {n: t.pin_memory() for n, t in payload.pools.items()}, payload.meta
            )
        if self.settings.host_bytes > 0:
            demoted = self._put_host(key, payload)
        else:
            demoted = [(key, payload)]
        return self._settle(demoted)

    def discard(self, key: Key) -> None:
        """Forget `key` in every tier (a load that failed verification)."""
        payload = self._host.pop(key, None)
        if payload is not None:
            self._host_bytes -= payload.nbytes
        if key in self._disk:
            self._forget_file(key)

    def refresh(self, now: float | None = None) -> tuple[list[Key], list[Key]]:
        """What engines sharing the directory changed since the last look (at most every `RESCAN_S`
        seconds): (keys whose files appeared, keys whose files vanished and that left the tier)."""
        now = time.monotonic() if now is None else now
        if self.dir is None or now - self._scanned_at < RESCAN_S:
            return [], []
        self._scanned_at = now
        on_disk = dict(self._listing())
        appeared = [k for k in on_disk if k not in self._disk]
        vanished = [k for k in self._disk if k not in on_disk]
        # one least-recently-used order for every engine on the directory: a file's mtime is its last
        # write or use (`_used` touches it)
        self._disk = OrderedDict((k, on_disk[k][1]) for k in sorted(on_disk, key=lambda k: on_disk[k][0]))
        self._disk_bytes = sum(self._disk.values())
        gone = [k for k in vanished if k not in self._host]
        gone += self._trim_disk()
        new = [k for k in appeared if k in self._disk and k not in self._host]
        self.stats.dropped += len(gone)
        return new, gone

    # -- internals ---------------------------------------------------------------------------------------
    def _put_host(self, key: Key, payload: BlockPayload) -> list[tuple[Key, BlockPayload]]:
        """Insert into the host LRU; returns the entries pushed out of it (oldest first)."""
        out = []
        self._host[key] = payload
        self._host_bytes += payload.nbytes
        while self._host_bytes > self.settings.host_bytes and self._host:
            old, p = self._host.popitem(last=False)
            self._host_bytes -= p.nbytes
            out.append((old, p))
        return out

    def _settle(self, pushed: list[tuple[Key, BlockPayload]]) -> list[Key]:
        """Entries leaving host memory go to disk if there is one; returns those that left altogether."""
        gone = []
        for key, payload in pushed:
            if key in self._disk:
                continue  # its file is still there
            if self.dir is None or payload.nbytes > self.settings.disk_bytes:
                gone.append(key)
                continue
            size = payload.save(self._path(key))
            self._disk[key] = size
            self._disk_bytes += size
            self.stats.demoted += 1
            gone += self._trim_disk()
        gone = [k for k in gone if k not in self]
        self.stats.dropped += len(gone)
        return gone

    def _used(self, key: Key) -> None:
        """Most recently used, here and for the engines sharing the directory (the file's mtime)."""
        self._disk.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(self._path(key))

    def _path(self, key: Key) -> Path:
        return self.dir / (key_name(key) + SUFFIX)

    def _forget_file(self, key: Key) -> None:
        self._disk_bytes -= self._disk.pop(key, 0)
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def _trim_disk(self) -> list[Key]:
        """Delete the least recently used files until the directory's known files fit the budget;
        returns the keys that left the tier with them."""
        gone = []
        while self._disk_bytes > self.settings.disk_bytes and self._disk:
            old = next(iter(self._disk))
            self._forget_file(old)
            if old not in self._host:
                gone.append(old)
        return gone

    def _listing(self) -> list[tuple[Key, tuple[float, int]]]:
        """(key, (mtime, size)) of every entry file in the directory."""
        found = []
        for path in self.dir.glob("*" + SUFFIX):
            try:
                h, c = path.stem.split("-")
                st = path.stat()
                found.append(((int(h, 16), int(c, 16)), (st.st_mtime, st.st_size)))
            except (ValueError, OSError):  # not an entry's name, or deleted by another engine meanwhile
                continue
        return found

    def _scan(self) -> None:
        """Files an earlier engine left: known, oldest first, within the budget (the oldest deleted)."""
        self._scanned_at = time.monotonic()
        for key, (_, size) in sorted(self._listing(), key=lambda item: item[1][0]):
            self._disk[key] = size
            self._disk_bytes += size
        self._trim_disk()
        if self._disk:
            logger.info(
                "KV disk tier %s: %d blocks (%d B) from earlier runs",
                self.dir,
                len(self._disk),
                self._disk_bytes,
            )
        for tmp in self.dir.glob("*" + SUFFIX + ".tmp*"):  # a writer's file: mid-write, or killed mid-file
            with contextlib.suppress(OSError, ValueError):
                if not _writer_alive(tmp) or time.time() - tmp.stat().st_mtime > STALE_TMP_S:
                    os.remove(tmp)


def _writer_alive(tmp: Path) -> bool:
    """Whether the process named in a temporary file's suffix (`.tmp<pid>`) runs on this host (a
    directory shared between hosts relies on the age limit instead)."""
    pid = int(tmp.name.rsplit(".tmp", 1)[1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
