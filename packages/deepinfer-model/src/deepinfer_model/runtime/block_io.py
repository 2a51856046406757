"""Cache state out of the paged pools and back in: the base of the KV tier and of request hand-off.

Everything a model keeps for a sequence lives in block-addressed pools (`pools.py`: SWA keys, compressed
entries, the compressor inputs of blocks not complete yet, index keys, Engram token ids, drafter keys,
YOCO slot tags), so a run of blocks is moved by copying each pool's rows of those blocks. An export is a
`BlockPayload`: per pool a host tensor [blocks, slots_per_block, dim] and JSON metadata. Importing it
writes those rows into other block ids of another cache with the same pool layout; the values are
bit-for-bit the stored ones (float32 / int64 pools), so a step after an import computes exactly what it
would have computed where the blocks were written.

The flat format (`to_bytes` / `from_bytes`, `save` / `load`): an 8-byte magic, a little-endian u32 format
version, a u64 header length, the JSON header (layout, metadata, per-buffer offsets, sizes and xxh3-64
checksums), the header's own xxh3-64 checksum (u64), then the buffers back to back. Reading verifies all
of it and names what does not match.

The copies run synchronously here; `export_blocks` / `import_blocks` take the whole run in one gather and
one scatter per pool, the place where a device stream would overlap them with other work.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from .pools import PagedKVCache

MAGIC = b"DIKVBLKS"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIQ")  # magic, version, header length
_CHECK = struct.Struct("<Q")
_DTYPES = {"float32": torch.float32, "int64": torch.int64}


class PayloadError(ValueError):
    """A payload that cannot be read or does not fit the cache (corrupt, another version or layout)."""


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise PayloadError(f"pool dtype must be one of {sorted(_DTYPES)}, got {name}")
    return name


@dataclass(frozen=True)
class PoolLayout:
    """One pool as a payload holds it: what a cache must match to take the payload."""

    name: str
    slots_per_block: int
    dim: int
    dtype: str


@dataclass
class BlockPayload:
    """Blocks' entries of every pool, on the host. `pools[name]`: [num_blocks, slots_per_block, dim];
    `meta`: JSON-serialisable facts about them (a request's tokens, prefix hashes, ...)."""

    block_size: int
    pools: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return next(iter(self.pools.values())).shape[0] if self.pools else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pools.values())

    def layout(self) -> list[PoolLayout]:
        return [PoolLayout(n, t.shape[1], t.shape[2], _dtype_name(t.dtype)) for n, t in self.pools.items()]

    def block(self, i: int, meta: dict | None = None) -> BlockPayload:
        """Block `i` alone (a per-block entry of a tier), with `meta` as its metadata."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block index must be in [0, {self.num_blocks}), got {i}")
        return BlockPayload(
            self.block_size, {n: t[i : i + 1].clone() for n, t in self.pools.items()}, dict(meta or {})
        )

    @staticmethod
    def concat(parts: list[BlockPayload], meta: dict | None = None) -> BlockPayload:
        """The blocks of `parts` in order (one layout and block size)."""
        if not parts:
            raise ValueError("concat needs at least one payload")
        first = parts[0]
        for p in parts[1:]:
            if p.block_size != first.block_size or p.layout() != first.layout():
                raise PayloadError("concat: payloads of different block sizes or pool layouts")
        pools = {n: torch.cat([p.pools[n] for p in parts]) for n in first.pools}
        return BlockPayload(first.block_size, pools, dict(meta or {}))

    # -- the flat format --------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        buffers, entries, offset = [], [], 0
        for name, t in self.pools.items():
            raw = t.detach().to("cpu").contiguous().numpy().tobytes()
            entries.append(
                dict(
                    name=name,
                    slots_per_block=int(t.shape[1]),
                    dim=int(t.shape[2]),
                    dtype=_dtype_name(t.dtype),
                    offset=offset,
                    nbytes=len(raw),
                    xxh3_64=xxhash.xxh3_64_intdigest(raw),
                )
            )
            buffers.append(raw)
            offset += len(raw)
        header = json.dumps(
            dict(block_size=self.block_size, num_blocks=self.num_blocks, pools=entries, meta=self.meta),
            separators=(",", ":"),
        ).encode()
        return b"".join(
            [
                _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)),
                header,
                _CHECK.pack(xxhash.xxh3_64_intdigest(header)),
                *buffers,
            ]
        )

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, source: str = "payload") -> BlockPayload:
        data = memoryview(data)
        if len(data) < _PREFIX.size:
            raise PayloadError(f"{source}: {len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
        magic, version, header_len = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise PayloadError(f"{source}: not a DeepInfer block payload (magic {bytes(magic)!r})")
        if version != FORMAT_VERSION:
            raise PayloadError(f"{source}: format version must be {FORMAT_VERSION}, got {version}")
        start = _PREFIX.size
        end = start + header_len
        if len(data) < end + _CHECK.size:
            raise PayloadError(f"{source}: truncated header ({len(data)} bytes)")
        header = bytes(data[start:end])
        (check,) = _CHECK.unpack_from(data, end)
        if xxhash.xxh3_64_intdigest(header) != check:
            raise PayloadError(f"{source}: header checksum mismatch")
        head = json.loads(header)
        base = end + _CHECK.size
        pools = {}
        for e in head["pools"]:
            lo, hi = base + e["offset"], base + e["offset"] + e["nbytes"]
            if hi > len(data):
                raise PayloadError(f"{source}: pool {e['name']} is truncated")
            raw = data[lo:hi]
            if xxhash.xxh3_64_intdigest(raw) != e["xxh3_64"]:
                raise PayloadError(f"{source}: pool {e['name']} checksum mismatch")
            dtype = _DTYPES.get(e["dtype"])
            if dtype is None:
                raise PayloadError(f"{source}: pool {e['name']} has unknown dtype {e['dtype']!r}")
            array = np.frombuffer(raw, dtype=str(dtype).removeprefix("torch."))
            shape = (head["num_blocks"], e["slots_per_block"], e["dim"])
            pools[e["name"]] = torch.from_numpy(array.copy()).reshape(shape)
        return cls(int(head["block_size"]), pools, head.get("meta", {}))

    def save(self, path: str | Path) -> int:
        """Write the flat format to `path` (staged and moved into place, so a reader never sees half a
        file); returns the bytes written."""
        path = Path(path)
        data = self.to_bytes()
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return len(data)

    @classmethod
    def load(cls, path: str | Path) -> BlockPayload:
        return cls.from_bytes(Path(path).read_bytes(), source=str(path))


def cache_layout(cache: PagedKVCache) -> list[PoolLayout]:
    return [PoolLayout(s.name, s.slots_per_block, s.dim, _dtype_name(s.dtype)) for s in cache.specs.values()]


def _rows(block_ids: torch.Tensor, per: int, device: torch.device) -> torch.Tensor:
    ids = block_ids.to(device)
    return (ids[:, None] * per + torch.arange(per, device=device)[None, :]).reshape(-1)


def _check_ids(cache: PagedKVCache, block_ids) -> torch.Tensor:
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64).reshape(-1), device="cpu")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= cache.num_blocks):
        raise ValueError(f"block_ids must be in [0, {cache.num_blocks}), got {ids.tolist()}")
    return ids


def export_blocks(cache: PagedKVCache, block_ids, block_size: int, meta: dict | None = None) -> BlockPayload:
    """Every pool's rows of `block_ids` (in that order), copied to the host; `block_size`: the cache's
    tokens per block (recorded: an import checks it)."""
    ids = _check_ids(cache, block_ids)
    pools = {}
    for name, pool in cache.pools.items():
        spec = cache.specs[name]
        rows = pool[_rows(ids, spec.slots_per_block, pool.device)]
        pools[name] = rows.reshape(len(ids), spec.slots_per_block, spec.dim).to("cpu")
    return BlockPayload(block_size, pools, dict(meta or {}))


def import_blocks(cache: PagedKVCache, block_ids, payload: BlockPayload, block_size: int) -> None:
    """Write `payload`'s blocks into `block_ids` of `cache` (same block size and pool layout, one id per
    block)."""
    ids = _check_ids(cache, block_ids)
    if payload.block_size != block_size:
        raise PayloadError(f"payload block_size {payload.block_size} != the cache's {block_size}")
    if len(ids) != payload.num_blocks:
        raise ValueError(
            f"block_ids must name one block per payload block ({payload.num_blocks}), got {len(ids)}"
        )
    want, have = cache_layout(cache), payload.layout()
    if want != have:
        names = {p.name for p in want}
        missing = sorted(names - {p.name for p in have})
        extra = sorted({p.name for p in have} - names)
        differ = sorted(p.name for p in have if p.name in names and p not in want)
        raise PayloadError(
            "the payload's pools do not match the cache's: "
            f"missing {missing}, unexpected {extra}, other shape or dtype {differ}"
        )
    for name, pool in cache.pools.items():
        spec = cache.specs[name]
        values = payload.pools[name].reshape(-1, spec.dim).to(pool.device)
        pool[_rows(ids, spec.slots_per_block, pool.device)] = values


def export_request(
    cache: PagedKVCache, block_table, num_tokens: int, block_size: int, **meta
) -> BlockPayload:
    """A sequence's state: the blocks of `block_table` that hold its first `num_tokens` tokens (the last
    one possibly partial: its compressor inputs are the state of entries not complete yet). `meta`
    travels along (e.g. `tokens`, and `prompt_len` under YOCO, which is keyed by the original prompt
    length)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    need = -(-num_tokens // block_size)
    table = np.asarray(block_table, dtype=np.int64).reshape(-1)
    if len(table) < need:
        raise ValueError(f"block_table holds {len(table)} blocks; {num_tokens} tokens need {need}")
    return export_blocks(cache, table[:need], block_size, dict(meta, num_tokens=int(num_tokens)))
