"""Hypothesis drives random add / step / abort sequences through a synchronous and an asynchronous
engine loop over the fake model, checking the scheduler's invariants after every step and, at the
end, that every request finished with exactly the reference token stream in both loops."""

from collections import Counter

import numpy as np
from deepinfer_sched import Scheduler, SchedulerConfig
from deepinfer_sched.testing import Driver, FakeModel, RequestSpec, expected_stream
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

V = 11  # small vocabulary: stop tokens and EOS happen often
BASES = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5])


class LoopChecker:
    """Per-step checks that need the scheduler's view before and after schedule()."""

    def __init__(self, cfg: SchedulerConfig, keys: dict):
        self.cfg = cfg
        self.keys = keys  # seq_id -> (priority, arrival)

    def on_schedule(self, out, waiting_before):
        cfg = self.cfg
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert out.num_seqs <= cfg.max_num_seqs
        assert int(out.query_lens.sum()) == out.num_batched_tokens == int(out.query_start_loc[-1])
        assert np.all(out.query_lens >= 1)
        assert len(set(out.seq_ids.tolist())) == out.num_seqs
        # Admission is strictly in (priority, arrival) order: whoever was admitted from the waiting
        # queue ranks before everyone left waiting.
        scheduled = set(out.seq_ids.tolist())
        admitted = [s for s in waiting_before if s in scheduled]
        left = [s for s in waiting_before if s not in scheduled]
        if admitted and left:
            assert max(self.keys[s] for s in admitted) < min(self.keys[s] for s in left)


def check_blocks(sched: Scheduler, cfg: SchedulerConfig) -> None:
    sched.check_invariants()
    bs = cfg.block_size
    refs = sched.block_ref_counts()
    free = sched.free_block_ids().tolist()
    assert len(free) == len(set(free))
    assert all(refs[b] == 0 for b in free)
    assert int((refs > 0).sum()) + len(free) == cfg.num_blocks  # used + free == total
    owners = Counter()
    where = {}
    for sid in sched.live_ids():
        table = sched.block_table(sid).tolist()
        assert len(table) == len(set(table))
        if sched.finish_reason(sid) is None:
            assert len(table) * bs >= sched.num_computed_tokens(sid)  # the table covers its KV
        for i, b in enumerate(table):
            owners[b] += 1
            where.setdefault(b, []).append((sid, i))
    assert all(refs[b] == owners.get(b, 0) for b in range(cfg.num_blocks))
    for b, places in where.items():
        if len(places) > 1:  # shared: only a cached full block at the same place of the same prefix
            assert sched.is_block_cached(b)
            idx = {i for _, i in places}
            assert len(idx) == 1
            i = idx.pop()
            prefixes = {tuple(sched.token_ids(sid)[: (i + 1) * bs].tolist()) for sid, _ in places}
            assert len(prefixes) == 1 and len(next(iter(prefixes))) == (i + 1) * bs


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4, 8]),
        max_model_len=st.integers(8, 40),
        extra_blocks=st.integers(0, 8),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(8, 48),
        chunked=st.booleans(),
        prefix=st.booleans(),
        hash_bits=st.sampled_from([64, 0]),
        num_spec=st.sampled_from([0, 1, 3]),
    )
    def setup(
        self,
        block_size,
        max_model_len,
        extra_blocks,
        max_num_seqs,
        budget,
        chunked,
        prefix,
        hash_bits,
        num_spec,
    ):
        budget = max(budget, block_size)
        if not chunked:
            budget = max(budget, max_model_len)
        self.cfg = SchedulerConfig(
            num_blocks=-(-max_model_len // block_size) + extra_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_prefix_caching=prefix,
            enable_chunked_prefill=chunked,
            num_speculative_tokens=num_spec,
            prefix_hash_bits=hash_bits,
        )
        self.specs: dict[int, RequestSpec] = {}
        self.keys: dict[int, tuple[int, int]] = {}
        self.aborted: set[int] = set()
        self.loops = []
        for asynchronous in (False, True):
            sched = Scheduler(self.cfg)
            checker = LoopChecker(self.cfg, self.keys)
            model = FakeModel(self.cfg.num_blocks, block_size, V)
            self.loops.append(Driver(sched, model, asynchronous, num_spec, on_schedule=checker.on_schedule))

    @rule(
        base=st.sampled_from(BASES),
        shared=st.integers(0, 16),
        tail=st.lists(st.integers(0, V - 1), max_size=12),
        max_tokens=st.integers(1, 24),
        min_tokens=st.integers(0, 3),
        eos=st.one_of(st.none(), st.integers(0, V - 1)),
        stops=st.lists(st.integers(0, V - 1), max_size=2),
        ignore_eos=st.booleans(),
        priority=st.sampled_from([0, 0, 1]),
    )
    def add(self, base, shared, tail, max_tokens, min_tokens, eos, stops, ignore_eos, priority):
        prompt = (base[:shared] + tail)[: self.cfg.max_model_len - 1] or [1]
        seq_id = len(self.specs)
        spec = RequestSpec(
            seq_id, prompt, max_tokens, min(min_tokens, max_tokens), tuple(stops), eos, ignore_eos, priority
        )
        for loop in self.loops:
            got = loop.sched.add_request(
                prompt,
                seq_id=seq_id,
                max_tokens=spec.max_tokens,
                min_tokens=spec.min_tokens,
                stop_token_ids=spec.stop_token_ids,
                eos_token_id=eos,
                ignore_eos=ignore_eos,
                priority=priority,
            )
            assert got == seq_id
        self.specs[seq_id] = spec
        self.keys[seq_id] = (priority, seq_id)

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for loop in self.loops:
            for _ in range(n):
                loop.step()
                check_blocks(loop.sched, self.cfg)

    @precondition(lambda self: len(self.specs) > 0)
    @rule(data=st.data())
    def abort(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.specs)))
        for loop in self.loops:
            loop.sched.abort(seq_id)
        self.aborted.add(seq_id)

    @invariant()
    def blocks_consistent(self):
        for loop in getattr(self, "loops", []):
            check_blocks(loop.sched, self.cfg)

    def teardown(self):
        if not hasattr(self, "loops"):
            return
        bound = 50 + sum(len(s.prompt) + s.max_tokens for s in self.specs.values())
        streams = []
        for loop in self.loops:
            loop.drain(bound)  # every request finishes: no starvation, no deadlock
            check_blocks(loop.sched, self.cfg)
            assert loop.sched.stats()["num_free_blocks"] == self.cfg.num_blocks
            streams.append({sid: loop.sched.output_token_ids(sid).tolist() for sid in self.specs})
        for sid, spec in self.specs.items():
            tokens, reason = expected_stream(spec, self.cfg.max_model_len, V)
            for loop, stream in zip(self.loops, streams):
                if sid in self.aborted:
                    assert stream[sid] == tokens[: len(stream[sid])]
                else:
                    assert stream[sid] == tokens
                    assert loop.sched.finish_reason(sid) == reason
        # Sync and async agree on every request that was not cut short by an abort.
        for sid in self.specs:
            if sid not in self.aborted:
                assert streams[0][sid] == streams[1][sid]


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_state_machine = SchedulerMachine.TestCase
