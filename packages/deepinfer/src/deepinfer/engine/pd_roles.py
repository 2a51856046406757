"""What a PROMPT or a COMPLETION engine does beyond a NORMAL one (engine spec: engine_type).

`PromptRole`: each request is prefilled as one sequence that samples nothing (the scheduler finishes it
"prefilled" and keeps its blocks); right after the step's update its prompt blocks are exported into a
`HandoffRecord`, and the sequence is released with the request. `CompletionRole`: a record is checked
against this engine's cache facts, its blocks imported into free blocks (once per sample: a COMPLETION
engine shares no blocks) and the request admitted holding them; the scheduler then feeds only the last
prompt token again.

Admission on the decode side reserves every admitted sequence's blocks up to its longest possible length
(prompt + max_tokens, within max_model_len): a COMPLETION engine cannot recompute a preempted sequence, so
it takes a request only when it can finish it. `capacity()` says what is left; a front holds hand-offs
that do not fit (`DecodeFull`).

Both roles run the synchronous loop without drafting: an import writes into free blocks, which a step
still in flight might be writing (a block freed by an abort or preemption in the schedule ahead).
"""

from __future__ import annotations

import logging

import numpy as np

from ..sampling_params import SamplingParams
from .handoff import HandoffRecord, check_handoff
from .images import ImagePrompt
from .tier_fingerprint import cache_facts, fingerprint_of

logger = logging.getLogger("deepinfer")

# What a PROMPT engine's one sequence per request runs with: it samples nothing, so only the budget
# checks see these; a fixed seed keeps the engine's seed stream untouched.
PREFILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, seq_seed=0)


class DecodeFull(RuntimeError):
    """The COMPLETION engine cannot take this hand-off now (blocks or sequences reserved); try later."""


def refuse_for_split_engines(params: SamplingParams, engine_type: str) -> None:
    if params.prompt_logprobs is not None:
        raise ValueError(
            f"prompt_logprobs are not computed by {engine_type} engines (prefill / decode disaggregation); "
            "leave prompt_logprobs unset"
        )


class PromptRole:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.facts = cache_facts(
            engine.model_path, engine.args, engine.runner, engine.truncation, engine.device
        )
        self.fingerprint = fingerprint_of(self.facts)
        self.requests: dict[str, tuple[SamplingParams, list[int] | None]] = {}
        self.handoffs: list[HandoffRecord] = []

    def admit(self, request_id: str, params: SamplingParams, seeds: list[int] | None) -> SamplingParams:
        """Remember the request's own parameters for its record; the params its prefill runs with."""
        refuse_for_split_engines(params, "prompt")
        self.requests[request_id] = (params, seeds)
        return PREFILL_PARAMS

    def on_finished(self, finished: dict[int, str]) -> None:
        """Called right after the scheduler's update: export every sequence that has just prefilled
        (its blocks are still held), before the table releases it."""
        engine = self.engine
        for seq_id, reason in finished.items():
            if reason != "prefilled":
                continue
            seq = engine.table.seqs.get(seq_id)
            if seq is None:
                continue
            state = seq.request
            try:
                self.handoffs.append(self._record(state, seq_id))
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                logger.warning("export of request %r failed", state.request_id, exc_info=e)
                engine.table.fail(state.request_id, f"export failed: {type(e).__name__}: {e}")

    def _record(self, state, seq_id: int) -> HandoffRecord:
        engine = self.engine
        bs = engine.args.block_size
        ids = list(state.prompt_token_ids)
        table = np.asarray(engine.scheduler.block_table(seq_id), dtype=np.int64)
        payload = engine.runner.export_blocks(table[: -(-len(ids) // bs)])
        params, seeds = self.requests.pop(state.request_id, (state.params, None))
        salt, meta = engine.truncation.cache_salt(len(ids)), {}
        if state.images is not None:  # the decode engine's prefix-cache namespace and allowed sentinels
            salt = state.images.cache_salt(salt)
            meta["images"] = state.images.handoff_meta()
        return HandoffRecord(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=ids,
            params=params,
            seeds=seeds,
            arrival_time=state.metrics.arrival_time,
            cache_salt=salt,
            block_size=bs,
            facts=self.facts,
            fingerprint=self.fingerprint,
            payload=payload,
            meta=meta,
        )

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def take(self) -> list[HandoffRecord]:
        out, self.handoffs = self.handoffs, []
        for record in out:
            self.requests.pop(record.request_id, None)
        return out


class CompletionRole:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.facts = cache_facts(
            engine.model_path, engine.args, engine.runner, engine.truncation, engine.device
        )
        self.fingerprint = fingerprint_of(self.facts)
        self.num_blocks = int(engine.scheduler.config.num_blocks)
        self.max_num_seqs = int(engine.args.max_num_seqs)

    def blocks_at_most(self, prompt_len: int, params: SamplingParams) -> int:
        """Blocks one sequence may hold by its end."""
        longest = min(prompt_len + params.max_tokens, self.engine.max_model_len)
        return -(-longest // self.engine.args.block_size)

    def capacity(self) -> dict:
        """Blocks and sequences not reserved by the requests this engine holds."""
        reserved = sum(
            self.blocks_at_most(len(s.prompt_token_ids), s.params) * s.params.n
            for s in self.engine.requests.values()
        )
        live = sum(s.params.n for s in self.engine.requests.values())
        return {"free_blocks": self.num_blocks - reserved, "free_seqs": self.max_num_seqs - live}

    def need(self, record: HandoffRecord) -> dict:
        n = record.params.n
        return {
            "free_blocks": self.blocks_at_most(len(record.prompt_token_ids), record.params) * n,
            "free_seqs": n,
        }

    def fits(self, record: HandoffRecord) -> bool:
        have = self.capacity()
        return all(have[k] >= v for k, v in self.need(record).items())

    def add(self, record: HandoffRecord) -> None:
        """Check, import and admit `record` (HandoffError / ValueError: refused; DecodeFull: later)."""
        engine = self.engine
        check_handoff(record, self.facts, self.fingerprint, engine.args.block_size)
        refuse_for_split_engines(record.params, "completion")
        need = self.need(record)
        if need["free_blocks"] > self.num_blocks or need["free_seqs"] > self.max_num_seqs:
            raise ValueError(
                f"request {record.request_id!r} needs {need['free_blocks']} KV blocks and {need['free_seqs']} "
                f"sequences at its longest; this completion engine has {self.num_blocks} blocks and "
                f"max_num_seqs={self.max_num_seqs}"
            )
        if not self.fits(record):
            raise DecodeFull(f"request {record.request_id!r}: {need} needed, {self.capacity()} free")
        per_seq = record.num_blocks
        free = np.asarray(engine.scheduler.free_block_ids(), dtype=np.int64)
        tables = [free[i * per_seq : (i + 1) * per_seq].tolist() for i in range(record.params.n)]
        for table in tables:
            engine.runner.import_blocks(table, record.payload)
        images = record.meta.get("images")
        if images is not None:  # a prompt prefilled with images: its sentinel positions and digests
            width = int(engine.model.weights.embed.shape[1])
            ids = list(record.prompt_token_ids)
            images = ImagePrompt.handed_off(ids, images["sentinel_positions"], images["digests"], width)
        engine.add_request(
            record.request_id,
            record.prompt,
            record.params,
            prompt_token_ids=list(record.prompt_token_ids),
            arrival_time=record.arrival_time,
            seeds=record.seeds,
            cached_blocks=tables,
            handed_off_images=images,
        )


def needs_role(engine_type: str, engine):
    if engine_type == "prompt":
        return PromptRole(engine)
    if engine_type == "completion":
        return CompletionRole(engine)
    return None


__all__ = ["CompletionRole", "DecodeFull", "PromptRole", "needs_role"]
