"""YOCO prefill truncation (spec v41-model §8) through the paged runtime, against the stateless forward.

The reference for a sequence of `tokens` whose prompt was `P` tokens is
`model.forward(tokens, yoco_keep_tokens=KEEP, yoco_mode=mode, yoco_prompt_len=P)`: rows after `P` are
decode (or recompute) continuation, rect_lo = P - KEEP stays put. Paged logits must equal it bit for bit
on every row both compute (compact computes only positions >= rect_lo), over random chunkings and batch
mixes, decode, rollback, prefix hits and preemption + recompute; a resume that would read consumer SWA
keys computed for another prompt length is refused.
"""

import numpy as np
import pytest
import torch
from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint
from deepinfer_model.models.deepseek_v41.yoco import YocoMode, YocoSettings
from deepinfer_model.models.grouped_attention import sizes
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

W, B, KEEP = 8, 6, 14  # tiny sliding window, default backtracking, minimal KEEP (n_prefill_layer = 3)
MODES = ["mask", "compact"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41yoco_paged"), seed=0))


@pytest.fixture(scope="module")
def engine_numerics(model):
    return DeepseekV41ForCausalLM(
        model.config, model.weights, model.engram.vocab, act_dtype=torch.bfloat16, quantize_kv=True
    )


def reference(model, tokens, prompt_len, mode) -> dict[int, torch.Tensor]:
    """Stateless truncated logits by absolute position (compact: the kept positions only)."""
    out = model.forward(
        torch.as_tensor(tokens),
        yoco_keep_tokens=KEEP,
        yoco_mode=mode,
        yoco_prompt_len=prompt_len,
        backtracking_tokens=B,
    )
    pos = range(len(tokens)) if out.kept_positions is None else out.kept_positions.tolist()
    return {int(p): out.logits[i] for i, p in enumerate(pos)}


class Driver:
    """Feeds `PagedRunner` steps of several sequences, taking blocks from a shuffled free list."""

    def __init__(self, model, mode, rng, block_size=4, num_blocks=96):
        self.model, self.mode, self.rng, self.bs = model, mode, rng, block_size
        self.runner = PagedRunner(
            model, num_blocks, block_size, yoco=YocoSettings(YocoMode(mode), KEEP), backtracking=B
        )
        self.free = [int(b) for b in rng.permutation(num_blocks)]

    def grow(self, seq, end):
        while len(seq["table"]) * self.bs < end:
            seq["table"].append(self.free.pop())

    def step(self, entries):
        """entries: (seq, start, q, n_logits) -> per entry its logits rows [n, V] (positions start+q-n..)."""
        for seq, start, q, _ in entries:
            self.grow(seq, start + q)
        batch = StepBatch.of(
            seq_ids=np.array([s["id"] for s, *_ in entries]),
            start_positions=np.array([e[1] for e in entries]),
            query_lens=np.array([e[2] for e in entries]),
            block_tables=[np.array(s["table"], dtype=np.int32) for s, *_ in entries],
            input_ids=np.concatenate([s["tokens"][a : a + q] for s, a, q, _ in entries]),
            logits_lens=np.array([e[3] for e in entries]),
            prompt_lens=[s["prompt_len"] for s, *_ in entries],
        )
        got = self.runner.execute(batch)
        out, row = [], 0
        for *_, n in entries:
            out.append(got[row : row + n])
            row += n
        return out


def comparable(mode, prompt_len, start, q):
    """Trailing rows of a chunk whose logits both compute (compact: positions >= rect_lo)."""
    if mode == "mask":
        return q
    return max(0, start + q - max(start, prompt_len - KEEP))


def check_rows(seq, start, q, got, ref):
    for k in range(got.shape[0]):
        pos = start + q - got.shape[0] + k
        assert torch.isfinite(got[k]).all(), f"seq {seq['id']} position {pos}: non-finite logits"
        assert torch.equal(got[k], ref[pos]), (
            f"seq {seq['id']} position {pos}: differs from the stateless forward"
        )


def run_random(model, mode, rng, n_seqs, max_prompt=40):
    drv = Driver(model, mode, rng, block_size=int(rng.choice([2, 4, 8])))
    vocab = model.config.vocab_size
    seqs = []
    for i in range(n_seqs):
        p = int(rng.integers(2, max_prompt + 1))
        toks = rng.integers(4, vocab, p + int(rng.integers(0, 7))).tolist()
        seqs.append(dict(id=i, tokens=toks, prompt_len=p, done=0, table=[]))
        seqs[-1]["ref"] = reference(model, toks, p, mode)
    checked = 0
    while any(s["done"] < len(s["tokens"]) for s in seqs):
        entries = []
        for s in seqs:
            left = len(s["tokens"]) - s["done"]
            if left == 0 or rng.random() < 0.25:
                continue
            q = int(min(left, rng.choice([1, int(rng.integers(2, 6)), int(rng.integers(1, left + 1))])))
            n = int(rng.integers(0, comparable(mode, s["prompt_len"], s["done"], q) + 1))
            entries.append((s, s["done"], q, n))
            s["done"] += q
        if not entries:
            continue
        rng.shuffle(entries)
        for (s, start, q, _), got in zip(entries, drv.step(entries), strict=True):
            check_rows(s, start, q, got, s["ref"])
            checked += got.shape[0]
    return checked


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), n_seqs=st.integers(1, 3), mode=st.sampled_from(MODES))
def test_random_chunkings_and_batches_equal_stateless(model, seed, n_seqs, mode):
    run_random(model, mode, np.random.default_rng(seed), n_seqs)


@pytest.mark.parametrize("mode", MODES)
def test_engine_numerics_bitwise(engine_numerics, mode):
    """BF16 activations and quantised KV, a fixed mixed schedule."""
    assert run_random(engine_numerics, mode, np.random.default_rng(11), 3) > 10


def _prefill(drv, seq, chunks, start=0):
    for q in chunks:
        last = start + q == len(seq["tokens"])
        drv.step([(seq, start, q, 1 if last else 0)])
        start += q
    return start


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b", [1, B, 2 * B + 3])
def test_rollback_into_the_prompt_then_new_tokens(model, mode, b):
    """Prefill P, decode 3, roll back b tokens into the prompt and continue with other tokens: equal to the
    stateless forward over the final tokens with the prompt's plan. (The paged pools keep every consumer
    SWA key of the sequence, so even b > B resumes from keys computed under the same rect_lo.)"""
    rng = np.random.default_rng(b)
    drv = Driver(model, mode, rng)
    P = 37
    toks = rng.integers(4, model.config.vocab_size, P + 3).tolist()
    seq = dict(id=0, tokens=toks, prompt_len=P, table=[])
    _prefill(drv, seq, [13, 9, 15, 1, 1, 1])
    new = toks[: P - b] + rng.integers(4, model.config.vocab_size, b + 4).tolist()
    seq["tokens"] = new
    ref = reference(model, new, P, mode)
    start = P - b
    for q in (2, 1, len(new) - start - 3):
        got = drv.step([(seq, start, q, comparable(mode, P, start, q))])[0]
        check_rows(seq, start, q, got, ref)
        start += q


@pytest.mark.parametrize("mode", MODES)
def test_prefix_hit_same_prompt_length_equals(model, mode):
    """B shares A's first 24 tokens (6 blocks) and has A's prompt length: it resumes from A's blocks."""
    rng = np.random.default_rng(5)
    drv = Driver(model, mode, rng)
    P, hit, V = 34, 24, model.config.vocab_size
    a_toks = rng.integers(4, V, P).tolist()
    a = dict(id=0, tokens=a_toks, prompt_len=P, table=[])
    _prefill(drv, a, [20, 14])
    b_toks = a_toks[:hit] + rng.integers(4, V, P - hit + 3).tolist()
    b = dict(id=1, tokens=b_toks, prompt_len=P, table=list(a["table"][: hit // drv.bs]))
    assert drv.runner.yoco_resume_problem(a["table"][: hit // drv.bs] + [0, 0, 0], hit, 10, P) is None
    ref = reference(model, b_toks, P, mode)
    start = hit
    for q in (7, 3, 1, 1, 1):
        got = drv.step([(b, start, q, 1)])[0]
        check_rows(b, start, q, got, ref)
        start += q


@pytest.mark.parametrize("mode", MODES)
def test_deep_prefix_hit_from_another_prompt_length_is_refused_then_recompute_equals(model, mode):
    """B (prompt 40) would resume at 32 from A's blocks (prompt 34, rect_lo 20 != 26): refused before any
    write; recomputing B from 0 in fresh blocks equals the stateless forward. A shallow hit (below B's
    rect_lo) reads no consumer SWA key and is accepted."""
    rng = np.random.default_rng(6)
    drv = Driver(model, mode, rng)
    V = model.config.vocab_size
    a_toks = rng.integers(4, V, 34).tolist()
    a = dict(id=0, tokens=a_toks, prompt_len=34, table=[])
    _prefill(drv, a, [34])
    b_toks = a_toks[:32] + rng.integers(4, V, 8).tolist()
    b = dict(id=1, tokens=b_toks, prompt_len=40, table=list(a["table"][:8]))
    reason = drv.runner.yoco_resume_problem(b["table"] + [drv.free[-1], drv.free[-2]], 32, 8, 40)
    assert reason and "rect_lo" in reason
    swa_before = drv.runner.cache.pools["swa.4"].clone()
    with pytest.raises(ValueError, match="prefix-cache hit"):
        drv.step([(b, 32, 8, 1)])
    assert torch.equal(swa_before.nan_to_num(7.0), drv.runner.cache.pools["swa.4"].nan_to_num(7.0))
    ref = reference(model, b_toks, 40, mode)
    # why refuse: B's truncated result depends on its own rect_lo, which A's cached keys do not reflect
    assert not torch.equal(ref[39], reference(model, b_toks, 34, mode)[39])
    fresh = dict(id=2, tokens=b_toks, prompt_len=40, table=[])
    got = drv.step([(fresh, 0, 40, 1)])[0]
    check_rows(fresh, 0, 40, got, ref)
    # shallow: hit 16 <= rect_lo 26 of B, nothing consumer-side is read from A's blocks
    shallow = dict(id=3, tokens=b_toks, prompt_len=40, table=list(a["table"][:4]))
    got = drv.step([(shallow, 16, 24, 1)])[0]
    check_rows(shallow, 16, 24, got, ref)


@pytest.mark.parametrize("mode", MODES)
def test_preemption_then_recompute_equals(model, mode):
    """Prefill + 4 decodes, preempted (blocks freed and poisoned with NaN), recomputed (prompt + generated
    tokens, in chunks, with the ORIGINAL prompt length) in other blocks, then 3 more decodes."""
    rng = np.random.default_rng(8)
    drv = Driver(model, mode, rng)
    P, V = 31, model.config.vocab_size
    toks = rng.integers(4, V, P + 7).tolist()
    seq = dict(id=0, tokens=toks, prompt_len=P, table=[])
    ref = reference(model, toks, P, mode)
    start = _prefill(drv, seq, [16, 15], 0)
    for _ in range(4):
        check_rows(seq, start, 1, drv.step([(seq, start, 1, 1)])[0], ref)
        start += 1
    drv.runner.cache.poison(seq["table"])
    drv.free = [b for b in drv.free if b not in seq["table"]][: len(drv.free) - 20]
    seq["table"] = []
    start = 0
    for q in (9, 20, 6):  # recompute 35 tokens; logits of the rows both compute
        got = drv.step([(seq, start, q, comparable(mode, P, start, q))])[0]
        check_rows(seq, start, q, got, ref)
        start += q
    for _ in range(3):
        check_rows(seq, start, 1, drv.step([(seq, start, 1, 1)])[0], ref)
        start += 1


def test_settings_are_checked_and_a_yoco_step_needs_prompt_lens(model):
    with pytest.raises(ValueError, match=r"8 \+ 6 = 14"):
        PagedRunner(model, 8, 4, yoco=YocoSettings(YocoMode.COMPACT, 13), backtracking=B)

    def step(prompt_lens=None):
        return StepBatch.of(
            seq_ids=np.array([0]),
            start_positions=np.array([0]),
            query_lens=np.array([3]),
            block_tables=[np.array([0])],
            input_ids=np.array([5, 6, 7]),
            logits_lens=np.array([1]),
            prompt_lens=prompt_lens,
        )

    # without truncation a step's prompt lengths (every scheduler step carries them) change nothing
    with_lens = PagedRunner(model, 8, 4).execute(step(prompt_lens=[3]))
    assert torch.equal(with_lens, PagedRunner(model, 8, 4).execute(step()))
    yoco = PagedRunner(model, 8, 4, yoco=YocoSettings(YocoMode.COMPACT, KEEP), backtracking=B)
    with pytest.raises(ValueError, match=r"original prompt length \(StepBatch.prompt_lens\)"):
        yoco.execute(step())


def test_compact_refuses_logits_of_a_skipped_prompt_row(model):
    """Prompt logprobs under compact would need rows the consumer half never computes."""
    runner = PagedRunner(model, 16, 4, yoco=YocoSettings(YocoMode.COMPACT, KEEP), backtracking=B)
    ids = np.arange(4, 34)
    batch = StepBatch.of(
        seq_ids=np.array([0]),
        start_positions=np.array([0]),
        query_lens=np.array([30]),
        block_tables=[np.arange(8)],
        input_ids=ids,
        logits_lens=np.array([20]),  # rows 10..29; rect_lo = 16
        prompt_lens=[30],
    )
    with pytest.raises(ValueError, match="prompt logprobs"):
        runner.execute(batch)


def _truncated_draft(model, mode, tokens, prompt_len, n, g):
    return model.forward(
        torch.tensor(tokens),
        yoco_keep_tokens=KEEP,
        yoco_mode=mode,
        yoco_prompt_len=prompt_len,
        backtracking_tokens=B,
        num_draft_tokens=n,
        next_token=g,
    ).draft


@pytest.mark.parametrize("mode", MODES)
def test_drafts_after_truncated_chunked_prefill_equal_stateless(model, mode):
    """DSpark targets (layers 3, 5) are consumer layers: compact builds their features / main keys from the
    kept rows only. Drafts after a batched, chunked truncated prefill (and after a decode) equal the
    stateless truncated forward's drafts bit for bit (tokens, logits, confidences)."""
    rng = np.random.default_rng(9)
    drv = Driver(model, mode, rng)
    V = model.config.vocab_size
    seqs = [
        dict(id=i, tokens=rng.integers(4, V, n).tolist(), prompt_len=n, table=[])
        for i, n in enumerate((33, 20))
    ]
    starts = [0, 0]
    for qs in ((12, 7), (13, 6), (8, 7)):  # both prompts end in the third step
        entries = [(s, a, q, int(a + q == s["prompt_len"])) for s, a, q in zip(seqs, starts, qs, strict=True)]
        logits = drv.step(entries)
        starts = [a + q for a, q in zip(starts, qs, strict=True)]
    nxt = [int(row[0].argmax()) for row in logits]
    drafts = drv.runner.draft(nxt, 4)
    for s, g, d in zip(seqs, nxt, drafts, strict=True):
        ref = _truncated_draft(model, mode, s["tokens"], s["prompt_len"], 4, g)
        assert torch.equal(d.tokens, ref.tokens) and torch.equal(d.logits, ref.logits)
        assert torch.equal(d.confidence, ref.confidence)
    s = seqs[0]
    s["tokens"] = s["tokens"] + [nxt[0]]
    drv.step([(s, 33, 1, 1)])  # a decode, then draft again
    d = drv.runner.draft([7], 3)[0]
    ref = _truncated_draft(model, mode, s["tokens"], 33, 3, 7)
    assert torch.equal(d.logits, ref.logits) and torch.equal(d.confidence, ref.confidence)


def test_make_runner_passes_yoco_and_recompute_refuses_it(model):
    from deepinfer_model.runtime import make_runner

    yoco = YocoSettings(YocoMode.MASK, KEEP)
    assert make_runner("paged", model, 8, 4, yoco=yoco, backtracking=B).yoco == yoco
    assert make_runner("paged", model, 8, 4).yoco is None
    with pytest.raises(ValueError, match="needs runner = 'paged'"):
        make_runner("recompute", model, 8, 4, yoco=yoco)


@pytest.mark.parametrize("mode", MODES)
def test_preempted_sequence_resumes_from_its_own_cached_blocks(model, mode):
    """Preempted after 3 decodes; the prefix cache kept its first 7 blocks (28 tokens, past rect_lo 19), the
    rest were freed and poisoned: resuming at 28 with the same prompt length reads its own keys and equals
    the stateless forward."""
    rng = np.random.default_rng(10)
    drv = Driver(model, mode, rng)
    P, V = 33, model.config.vocab_size
    toks = rng.integers(4, V, P + 6).tolist()
    seq = dict(id=0, tokens=toks, prompt_len=P, table=[])
    ref = reference(model, toks, P, mode)
    start = _prefill(drv, seq, [20, 13])
    for _ in range(3):
        drv.step([(seq, start, 1, 1)])
        start += 1
    drv.runner.cache.poison(seq["table"][7:])
    seq["table"] = seq["table"][:7]
    assert drv.runner.yoco_resume_problem(seq["table"] + [drv.free[-1], drv.free[-2]], 28, 8, P) is None
    got = drv.step([(seq, 28, 8, 8)])[0]
    check_rows(seq, 28, 8, got, ref)
    check_rows(seq, 36, 1, drv.step([(seq, 36, 1, 1)])[0], ref)


@pytest.mark.parametrize("mode", MODES)
def test_chunk_before_rect_lo_batched_with_a_wider_window(model, mode):
    """Regression: a chunk wholly below its rect_lo (no consumer SWA key stored) attends in one group with a
    sequence whose window is wider; its padding columns re-read a never-stored slot (NaN in a fresh pool)
    and must be zeroed, not just masked."""
    rng = np.random.default_rng(12)
    drv = Driver(model, mode, rng)
    V = model.config.vocab_size
    a = dict(id=0, tokens=rng.integers(4, V, 21).tolist(), prompt_len=21, table=[])  # rect_lo 7
    b = dict(id=1, tokens=rng.integers(4, V, 40).tolist(), prompt_len=40, table=[])
    drv.step([(a, 0, 4, 0), (b, 0, 29, 0)])
    n = comparable(mode, 21, 4, 3)
    got_a, got_b = drv.step([(a, 4, 3, n), (b, 29, 3, 3)])
    check_rows(a, 4, 3, got_a, reference(model, a["tokens"], 21, mode))
    check_rows(b, 29, 3, got_b, reference(model, b["tokens"], 40, mode))


@pytest.mark.parametrize("mode", MODES)
def test_row_blocked_query_side_equals_stateless(model, monkeypatch, mode):
    """Steps longer than a query block (3 rows here) run the consumer half's queries per row block of the
    kept rows (compact) or of every row (mask): still the stateless truncated forward, bit for bit."""
    cfg = model.config
    monkeypatch.setattr(sizes, "QUERY_BLOCK_ELEMENTS", 3 * cfg.num_attention_heads * cfg.head_dim)
    assert run_random(model, mode, np.random.default_rng(11), 3) > 0
