"""A prefilled request on its way from a PROMPT engine to a COMPLETION engine: the hand-off record.

A PROMPT engine prefills a request, exports the blocks holding its prompt (`ModelRunner.export_blocks`,
every pool the model keeps: SWA keys, compressed entries and the state of incomplete compressed blocks,
index keys, Engram ids, drafter keys) and sends this record; a COMPLETION engine with the same cache
facts imports the blocks into free blocks of its own and decodes from there (the scheduler feeds the
last prompt token again, so its logits, the first output token's, are computed where the decoding runs).

The flat form (`to_bytes` / `from_bytes`): an 8-byte magic, a little-endian u64 header length, the header
(pickled: the request's fields and its `SamplingParams`, which may hold callables such as logits
processors), then the payload in `BlockPayload`'s own checksummed format. Pickle trusts the sender: the
transports connect engines of one deployment, never an untrusted peer.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, field

from deepinfer_model import BlockPayload

from ..sampling_params import SamplingParams

MAGIC = b"DIHANDOF"
_PREFIX = struct.Struct("<8sQ")


class HandoffError(ValueError):
    """A hand-off this engine cannot take (other cache facts, block size, or a malformed record)."""


@dataclass
class HandoffRecord:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seeds: list[int] | None  # the n samples' seeds (None: the decoding engine draws them)
    arrival_time: float | None
    cache_salt: int
    block_size: int
    facts: dict  # tier_fingerprint.cache_facts of the engine that prefilled
    fingerprint: str
    payload: BlockPayload
    meta: dict = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        head = {k: v for k, v in self.__dict__.items() if k != "payload"}
        header = pickle.dumps(head, protocol=pickle.HIGHEST_PROTOCOL)
        return b"".join([_PREFIX.pack(MAGIC, len(header)), header, self.payload.to_bytes()])

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> HandoffRecord:
        data = memoryview(data)
        if len(data) < _PREFIX.size:
            raise HandoffError(
                f"hand-off of {len(data)} bytes is shorter than its {_PREFIX.size}-byte prefix"
            )
        magic, n = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise HandoffError(f"not a DeepInfer hand-off record (magic {bytes(magic)!r})")
        end = _PREFIX.size + n
        if len(data) < end:
            raise HandoffError(f"hand-off header truncated ({len(data)} bytes, header of {n})")
        head = pickle.loads(data[_PREFIX.size : end])
        payload = BlockPayload.from_bytes(
            data[end:], source=f"hand-off of request {head.get('request_id')!r}"
        )
        return cls(payload=payload, **head)

    @staticmethod
    def peek(data: bytes | memoryview) -> dict:
        """The header fields of a flat record (all but the payload), reading only its header (a front
        routes records unparsed)."""
        data = memoryview(data)
        magic, n = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise HandoffError(f"not a DeepInfer hand-off record (magic {bytes(magic)!r})")
        return pickle.loads(data[_PREFIX.size : _PREFIX.size + n])

    @property
    def num_blocks(self) -> int:
        """Blocks one sequence of the request takes on the decoding engine."""
        return -(-len(self.prompt_token_ids) // self.block_size)


def check_handoff(record: HandoffRecord, facts: dict, fingerprint: str, block_size: int) -> None:
    """Refuse a record this engine's pools cannot take, naming what differs."""
    if record.block_size != block_size:
        raise HandoffError(
            f"hand-off of request {record.request_id!r}: block_size {record.block_size} != this engine's "
            f"{block_size}"
        )
    if record.fingerprint != fingerprint:
        differ = sorted(k for k in set(facts) | set(record.facts) if facts.get(k) != record.facts.get(k))
        raise HandoffError(
            f"hand-off of request {record.request_id!r} comes from an engine with other cache facts "
            f"(differing: {', '.join(differ) or 'unknown'}); both engines need the same checkpoint, dtype, "
            "device kind, numerics, YOCO truncation and pool layout"
        )
    if record.payload.block_size != block_size or record.payload.num_blocks != record.num_blocks:
        raise HandoffError(
            f"hand-off of request {record.request_id!r}: payload of {record.payload.num_blocks} blocks of "
            f"{record.payload.block_size} tokens; its {len(record.prompt_token_ids)}-token prompt needs "
            f"{record.num_blocks} of {block_size}"
        )
