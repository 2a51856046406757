"""The in-run baseline for bench_scheduler.py: a straightforward, carefully written pure-Python
scheduler with the same policy as deepinfer_sched for the benchmark's workload (FIFO admission,
chunked prefill under a token budget, one decode token per running sequence, preemption by
recompute of the latest arrival, prefix caching with confirmed hits and LRU reuse of freed blocks)
and the same flat numpy step arrays (input ids, positions, slot mapping, seq lens, padded block
tables). It exists only to be measured against; the engine uses the C++ scheduler."""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque

import numpy as np


class PySeq:
    __slots__ = ("seq_id", "tokens", "num_prompt", "max_tokens", "num_computed", "table", "chain", "finished")

    def __init__(self, seq_id: int, prompt: list[int], max_tokens: int):
        self.seq_id = seq_id
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.max_tokens = max_tokens
        self.num_computed = 0
        self.table: list[int] = []
        self.chain: list[tuple] = []  # keys of its registered full blocks
        self.finished = False


class PyBlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU order
        self.key_of: list[tuple | None] = [None] * num_blocks
        self.cache: dict[tuple, int] = {}  # key -> block; key = (parent key, block tokens): exact

    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        b, _ = self.free.popitem(last=False)
        key = self.key_of[b]
        if key is not None:
            del self.cache[key]
            self.key_of[b] = None
        self.ref[b] = 1
        return b

    def match(self, tokens: list[int], max_blocks: int) -> tuple[list[int], list[tuple]]:
        bs, blocks, keys, parent = self.block_size, [], [], None
        for i in range(max_blocks):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            b = self.cache.get(key)
            if b is None:
                break
            blocks.append(b)
            keys.append(key)
            parent = key
        return blocks, keys

    def claim(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def free_table(self, table: list[int]) -> None:
        for b in reversed(table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if self.key_of[b] is None:
                    self.free.move_to_end(b, last=False)  # nothing cached: reuse first

    def register(self, seq: PySeq) -> None:
        bs = self.block_size
        full = min(seq.num_computed, len(seq.tokens)) // bs
        for i in range(len(seq.chain), full):
            parent = seq.chain[-1] if seq.chain else None
            key = (parent, tuple(seq.tokens[i * bs : (i + 1) * bs]))
            if key not in self.cache:
                b = seq.table[i]
                self.cache[key] = b
                self.key_of[b] = key
            seq.chain.append(key)


class PyStep:
    __slots__ = (
        "seqs",
        "queries",
        "input_ids",
        "positions",
        "slot_mapping",
        "seq_lens",
        "query_start_loc",
        "block_tables",
        "num_batched_tokens",
        "any_prefill",
    )


class PyScheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        self.bm = PyBlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[PySeq] = deque()
        self.running: list[PySeq] = []
        self.num_preemptions = 0
        self.num_unfinished = 0

    def add_request(self, seq_id: int, prompt: list[int], max_tokens: int) -> None:
        self.waiting.append(PySeq(seq_id, prompt, max_tokens))
        self.num_unfinished += 1

    def _ensure_blocks(self, seq: PySeq, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.table)
        if need > self.bm.num_free():
            return False
        for _ in range(need):
            seq.table.append(self.bm.allocate())
        return True

    def _preempt(self, seq: PySeq) -> None:
        self.running.remove(seq)
        self.bm.register(seq)
        self.bm.free_table(seq.table)
        seq.table, seq.chain, seq.num_computed = [], [], 0
        i = 0  # back into the waiting queue by arrival (seq ids are given in arrival order)
        while i < len(self.waiting) and self.waiting[i].seq_id < seq.seq_id:
            i += 1
        self.waiting.insert(i, seq)
        self.num_preemptions += 1

    def schedule(self) -> PyStep:
        budget = self.max_num_batched_tokens
        queries: list[tuple[PySeq, int, int]] = []  # (seq, start, q)
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed
            q = min(len(seq.tokens) - start, budget)
            fits = True
            while start + q > len(seq.table) * self.block_size and not self._ensure_blocks(seq, start + q):
                victim = self.running[-1]  # the latest arrival
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    fits = False
                    break
            if not fits:
                continue
            queries.append((seq, start, q))
            budget -= q
            i += 1
        if not preempted:
            while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
                seq = self.waiting[0]
                hits, keys = self.bm.match(seq.tokens, (len(seq.tokens) - 1) // self.block_size)
                start = len(hits) * self.block_size
                q = min(len(seq.tokens) - start, budget)
                fresh = -(-(start + q) // self.block_size) - len(hits)
                free_hits = sum(1 for b in hits if self.bm.ref[b] == 0)
                if fresh > self.bm.num_free() - free_hits:
                    break
                self.bm.claim(hits)
                seq.table = hits + [self.bm.allocate() for _ in range(fresh)]
                seq.chain = keys
                seq.num_computed = start
                self.waiting.popleft()
                bisect.insort(self.running, seq, key=lambda s: s.seq_id)
                queries.append((seq, start, q))
                budget -= q
        return self._build(queries)

    def _build(self, queries) -> PyStep:
        bs = self.block_size
        input_ids, positions, slots, seq_lens, qsl, tables = [], [], [], [], [0], []
        any_prefill = False
        for seq, start, q in queries:
            end = start + q
            table = seq.table
            if q == 1 and end == len(seq.tokens):  # decode: the common case, kept cheap
                input_ids.append(seq.tokens[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.tokens[start:end])
                positions.extend(range(start, end))
                slots.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
                any_prefill = True
            seq_lens.append(end)
            qsl.append(qsl[-1] + q)
            tables.append(table[: -(-end // bs)])
        width = max((len(t) for t in tables), default=0)
        step = PyStep()
        step.seqs = [seq for seq, _, _ in queries]
        step.queries = queries
        step.input_ids = np.array(input_ids, dtype=np.int32)
        step.positions = np.array(positions, dtype=np.int32)
        step.slot_mapping = np.array(slots, dtype=np.int64)
        step.seq_lens = np.array(seq_lens, dtype=np.int32)
        step.query_start_loc = np.array(qsl, dtype=np.int32)
        step.block_tables = np.array([t + [-1] * (width - len(t)) for t in tables], dtype=np.int32).reshape(
            -1, width
        )
        step.num_batched_tokens = qsl[-1]
        step.any_prefill = any_prefill
        return step

    def update_from_output(self, step: PyStep, sampled: np.ndarray) -> list[int]:
        finished = []
        tokens = sampled.tolist()
        bs = self.block_size
        for (seq, start, q), token in zip(step.queries, tokens):
            seq.num_computed = start + q
            if seq.num_computed < len(seq.tokens):  # a prompt chunk that does not end the prompt
                self.bm.register(seq)
                continue
            seq.tokens.append(token)
            if seq.num_computed // bs > len(seq.chain):  # a block just filled up
                self.bm.register(seq)
            if len(seq.tokens) - seq.num_prompt >= seq.max_tokens or len(seq.tokens) >= self.max_model_len:
                seq.finished = True
                self.running.remove(seq)
                self.bm.free_table(seq.table)
                seq.table = []
                self.num_unfinished -= 1
                finished.append(seq.seq_id)
        return finished
