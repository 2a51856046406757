"""An instant fake model for tests and benchmarks of the scheduler (no torch, no weights).

The "model" emits ``fake_token(seq_id, position)`` as the token at each position, so a request's
output stream is known in advance (``expected_stream``) and must come out identical whatever the
batching, chunking, preemption, prefix caching or asynchronous scheduling did. With ``check_kv`` it
also keeps a fake paged KV cache (one token id per slot) and, for every scheduled sequence, checks
that the slots its block table maps for positions ``0 .. seq_len-1`` hold exactly its tokens: wrong
slot mappings, block tables, positions or prefix-cache reuse all show up as a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer_sched.scheduler import Scheduler


def fake_token(seq_id: int, position: int, vocab_size: int) -> int:
    """The token the fake model puts at ``position`` of sequence ``seq_id``."""
    x = (seq_id * 0x9E3779B1 + position * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return int(x % vocab_size)


@dataclass
class RequestSpec:
    seq_id: int
    prompt: list[int]
    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    ignore_eos: bool = False
    priority: int = 0


def expected_stream(spec: RequestSpec, max_model_len: int, vocab_size: int) -> tuple[list[int], str]:
    """The output tokens and finish reason the scheduler must produce for ``spec`` (pure Python)."""
    out: list[int] = []
    prompt_len = len(spec.prompt)
    while True:
        t = fake_token(spec.seq_id, prompt_len + len(out), vocab_size)
        out.append(t)
        n = len(out)
        is_stop = (not spec.ignore_eos and t == spec.eos_token_id) or t in spec.stop_token_ids
        if n > spec.min_tokens and is_stop:
            return out, "stop"
        if n >= spec.max_tokens:
            return out, "length"
        if prompt_len + n >= max_model_len:
            return out, "max_model_len"


class FakeModel:
    """Runs a ``SchedulerOutput``: checks its inputs, writes the fake KV, returns sampled tokens."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int, check_kv: bool = True):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.check_kv = check_kv
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)

    def run(self, sched: Scheduler, out, input_ids: np.ndarray | None = None) -> list[list[int]]:
        """Per scheduled sequence: the accepted drafts plus the next token (greedy verification),
        or ``[]`` for a prompt chunk that does not end its prompt.

        ``input_ids`` replaces ``out.input_ids`` (a device that fills in the tokens of a step scheduled
        ahead). Rows of sequences that finished meanwhile get a dummy token, as on a device that
        does not know yet; the scheduler must drop it."""
        ids = out.input_ids if input_ids is None else input_ids
        if np.any(ids < 0):
            raise AssertionError("the fake model needs exact inputs (reconcile the step first)")
        qsl, pos, slots = out.query_start_loc, out.positions, out.slot_mapping
        tables, seq_lens, emits = out.block_tables, out.seq_lens, out.emits_tokens
        bs = self.block_size
        result: list[list[int]] = []
        for i, seq_id in enumerate(out.seq_ids.tolist()):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            if sched.finish_reason(seq_id) is not None:
                result.append([0] if emits[i] else [])
                continue
            committed = sched.token_ids(seq_id)
            p = pos[lo:hi]
            expect_slots = tables[i][p // bs].astype(np.int64) * bs + p % bs
            if not np.array_equal(expect_slots, slots[lo:hi]):
                raise AssertionError(f"seq {seq_id}: slot_mapping disagrees with block_tables")
            if not np.array_equal(p, np.arange(seq_lens[i] - (hi - lo), seq_lens[i])):
                raise AssertionError(f"seq {seq_id}: positions are not contiguous up to seq_len")
            known = p < len(committed)
            if not np.array_equal(ids[lo:hi][known], committed[p[known]]):
                raise AssertionError(f"seq {seq_id}: input ids differ from the committed tokens")
            self.kv[slots[lo:hi]] = ids[lo:hi]
            if self.check_kv:
                ctx = np.arange(min(int(seq_lens[i]), len(committed)))
                ctx_slots = tables[i][ctx // bs].astype(np.int64) * bs + ctx % bs
                if np.any(tables[i][ctx // bs] < 0) or not np.array_equal(self.kv[ctx_slots], committed[ctx]):
                    raise AssertionError(f"seq {seq_id}: KV cache content differs from its tokens")
            if not emits[i]:
                result.append([])
                continue
            # Greedy verification: the golden token after position p is fake_token(p + 1); drafts
            # are accepted while they equal the golden token before them.
            if out.is_prefill[i]:  # the last prompt position produces the first new token
                result.append([fake_token(seq_id, int(p[-1]) + 1, self.vocab_size)])
                continue
            golden = [fake_token(seq_id, int(x) + 1, self.vocab_size) for x in p]
            drafts = ids[lo + 1 : hi].tolist()
            a = 0
            while a < len(drafts) and drafts[a] == golden[a]:
                a += 1
            result.append(golden[: a + 1])
        return result


def propose_drafts(seq_id: int, length: int, k: int, vocab_size: int, salt: int = 0) -> list[int]:
    """A deterministic fake drafter: the true next tokens, some of them deliberately wrong."""
    drafts = []
    for j in range(k):
        t = fake_token(seq_id, length + j, vocab_size)
        if fake_token(seq_id * 7 + salt, length * 3 + j, 4) == 0:
            t = (t + 1) % vocab_size
        drafts.append(t)
    return drafts


class Driver:
    """The engine loop around a scheduler and the fake model, synchronous or one step ahead.

    Synchronous: ``schedule -> run -> update_from_output -> propose drafts``.
    Asynchronous: schedule step N+1 while step N is unprocessed, then run N, update it, propose
    drafts, and ``reconcile`` N+1 before running it. Both must produce identical token streams.
    ``on_schedule(out, waiting_before)`` is called for every freshly scheduled output.
    """

    def __init__(
        self,
        sched: Scheduler,
        model: FakeModel,
        asynchronous: bool = False,
        num_drafts: int = 0,
        on_schedule=None,
        on_update=None,
    ):
        self.sched = sched
        self.model = model
        self.asynchronous = asynchronous
        self.num_drafts = num_drafts
        self.on_schedule = on_schedule
        self.on_update = on_update
        self.pending = None
        self.finished: dict[int, str] = {}

    def _schedule(self):
        waiting_before = self.sched.waiting_ids()
        out = self.sched.schedule()
        if self.on_schedule is not None:
            self.on_schedule(out, waiting_before)
        return out

    def _process(self, out) -> None:
        sampled = self.model.run(self.sched, out)
        for seq_id, reason in self.sched.update_from_output(out, sampled):
            self.finished[seq_id] = reason
        if self.on_update is not None:
            self.on_update(out)
        if self.num_drafts:
            for seq_id, toks in zip(out.seq_ids.tolist(), sampled):
                if toks and seq_id not in self.finished and self.sched.finish_reason(seq_id) is None:
                    n = len(self.sched.token_ids(seq_id))
                    self.sched.set_draft_tokens(
                        seq_id, propose_drafts(seq_id, n, self.num_drafts, self.model.vocab_size)
                    )

    def step(self) -> None:
        if not self.asynchronous:
            self._process(self._schedule())
            return
        if self.pending is None:
            self.pending = self._schedule()
            return
        ahead = self._schedule()
        self._process(self.pending)
        self.pending = self.sched.reconcile(ahead)

    def drain(self, max_steps: int) -> int:
        """Steps until every request finished (and nothing is pending); returns the steps taken."""
        for n in range(max_steps):
            if not self.sched.has_unfinished() and self.pending is None:
                return n
            if not self.sched.has_unfinished() and self.pending is not None:
                self._process(self.pending)
                self.pending = None
                continue
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps (starvation or deadlock)")
