"""Speculative decoding in the engine loop on the random-weight §11 tiny V4.1 (it has DSpark draft blocks).

References: plain decoding of the same engine with drafts off, the stateless model's greedy loop, and
the exact float64 distribution of short continuations computed from the stateless model's logits.
"""

from collections import Counter

import pytest
import torch
from deepinfer import SamplingParams
from deepinfer.engine.drafting import OracleDrafter
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_spec import StepTimeCurve

PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42]]


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    path = make_v41_checkpoint(tmp_path_factory.mktemp("v41-spec"), seed=0)
    return path


def run(path, params, nextn=0, drafter=None, prompts=PROMPTS, **kw):
    """Token ids per prompt and the engine (for its statistics)."""
    kw.setdefault("max_model_len", 48)
    args = EngineArgs(model=str(path), block_size=16, **kw)
    engine = LLMEngine(args, num_speculative_tokens=nextn)
    if drafter is not None:
        engine.spec.drafter = drafter(engine.model)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for j, (prompt, p) in enumerate(zip(prompts, plist)):
        engine.add_request(str(j), None, p, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    engine.close()
    return [outs[str(j)] for j in range(len(prompts))], engine


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


GREEDY = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(v41):
    """Greedy decoding of PROMPTS with drafts off: the reference of the greedy tests."""
    outs, engine = run(v41, GREEDY)
    assert engine.stats.steps == GREEDY.max_tokens
    return tokens(outs)


def test_greedy_with_model_drafts_equals_plain_greedy_for_several_nextn(v41, plain):
    for nextn in (1, 4):
        spec, engine = run(v41, GREEDY, nextn=nextn)
        assert tokens(spec) == plain, nextn
        s = engine.spec_stats()
        assert s["verified"] > 0 and s["nextn"] == nextn
        # the random drafter's drafts are verified; each request step emits 1 + accepted tokens
        assert s["tokens_per_request_step"] == pytest.approx(1 + s["avg_accepted_len"])
        # the confidence head's reliability bins hold every verified draft; greedy accept probs are 1 or 0
        bins = s["confidence_reliability"]
        assert sum(b["count"] for b in bins) == s["verified"]
        for b in bins:
            assert b["low"] <= b["mean_confidence"] <= b["high"]
            assert (b["mean_accept_prob"] * b["count"]) == pytest.approx(
                round(b["mean_accept_prob"] * b["count"])
            )


def test_oracle_drafts_all_accepted_and_each_step_emits_one_plus_k(v41, plain):
    k, m = 3, 2
    p, prompts = GREEDY, PROMPTS
    assert p.max_tokens == 1 + m * (1 + k)
    spec, engine = run(v41, p, nextn=k, drafter=OracleDrafter, prompts=prompts)
    assert tokens(spec) == plain
    s = engine.spec_stats()
    assert s["accepted"] == s["verified"] == len(prompts) * m * k
    assert s["accept_rate_per_position"] == [1.0] * k
    assert s["tokens_per_request_step"] == 1 + k
    assert engine.stats.steps == 1 + m  # the prefill step, then m verification steps of 1 + k tokens
    for o in spec:
        assert o.metrics.num_draft_tokens == o.metrics.num_accepted_draft_tokens == m * k
    # Stateless greedy loop (independent of scheduler and runner) agrees too.
    model = engine.model
    ids = list(prompts[0])
    for _ in range(p.max_tokens):
        ids.append(int(torch.argmax(model.forward(torch.tensor(ids)).logits[-1])))
    assert spec[0].outputs[0].token_ids == ids[len(prompts[0]) :]


def test_rejected_drafts_leave_no_trace_under_preemption(v41, plain):
    """A KV pool too small for all sequences forces preemption + recompute mid-speculation."""
    prompts = [list(range(40, 54)), list(range(90, 104))]  # 14 + 9 tokens: two blocks each, 3 exist
    ref, _ = run(v41, GREEDY, prompts=prompts)
    spec, engine = run(v41, GREEDY, nextn=4, num_kv_blocks=3, prompts=prompts)
    stats = engine.scheduler_stats()
    assert stats["num_preemptions"] > 0
    assert tokens(spec) == tokens(ref)
    engine.scheduler.check_invariants()
    assert stats["num_free_blocks"] == stats["num_blocks"]  # no block left behind by rejected drafts


def test_varlen_with_a_curve_keeps_greedy_exact(v41, plain, tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    # Step time grows steeply past 4 tokens: the rule verifies fewer than all drafts.
    curve = StepTimeCurve([1, 2, 4, 8, 16, 32], [1.0, 1.0, 1.0, 50.0, 100.0, 200.0], mode="linear")
    curve.save(tmp_path / "curve.json")
    args = EngineArgs(model=str(v41), block_size=16, max_model_len=48)
    engine = LLMEngine(args, num_speculative_tokens=5, step_time_curve=tmp_path / "curve.json")
    assert engine.spec_stats()["varlen"]
    for j, prompt in enumerate(PROMPTS):
        engine.add_request(str(j), None, GREEDY, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert [[outs[str(j)].outputs[0].token_ids] for j in range(3)] == plain
    s = engine.spec_stats()
    assert 0 < s["avg_verified_len"] < 5  # a prefix of the drafts, not all of them


@pytest.mark.parametrize(
    "prompts, sizes",
    [
        ([list(range(30, 60)), list(range(100, 120))], [1, 2, 4, 8]),  # a 50-token prompt step
        (PROMPTS, [1, 2]),  # decode steps of 3 sequences: at least 3 tokens
    ],
    ids=["prompt-step", "more-sequences"],
)
def test_varlen_survives_steps_larger_than_its_curve(v41, monkeypatch, prompts, sizes):
    """Steps holding more tokens than the step-time curve covers (prompt steps; decode steps of more sequences
    than it was measured for) are not fed back to it, and decoding goes on, greedy-exact."""
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    ref, _ = run(v41, GREEDY, prompts=prompts, max_model_len=64)
    curve = StepTimeCurve(sizes, [1.0] * len(sizes), mode="linear")
    args = EngineArgs(model=str(v41), block_size=16, max_model_len=64)
    engine = LLMEngine(args, num_speculative_tokens=3, step_time_curve=curve)
    for j, prompt in enumerate(prompts):
        engine.add_request(str(j), None, GREEDY, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    engine.close()
    assert [o.error for o in outs.values()] == [None] * len(prompts)
    assert [[outs[str(j)].outputs[0].token_ids] for j in range(len(prompts))] == tokens(ref)
    assert engine.spec_stats()["verified"] > 0 or sizes[-1] < len(prompts)


def test_sampled_with_drafts_is_seeded_and_batch_independent(v41):
    p = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seq_seed=11 + j)
        for j in range(3)
    ]
    a, _ = run(v41, p, nextn=3)
    alone, _ = run(v41, p[1:2], nextn=3, prompts=PROMPTS[1:2])
    # the second request's draws depend only on its seed and positions, not on its batch
    assert tokens(a)[1] == tokens(alone)[0]


def _exact_distribution(model, prompt, steps, top_k, temperature):
    """P(continuation) of plain top-k sampling, float64, by enumeration."""
    frontier = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for cont, prob in frontier.items():
            logits = model.forward(torch.tensor(prompt + list(cont))).logits[-1].double()
            top = torch.topk(logits, top_k)
            p = torch.softmax(top.values / temperature, dim=-1)
            for t, q in zip(top.indices.tolist(), p.tolist()):
                nxt[cont + (t,)] = prob * q
        frontier = nxt
    return frontier


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
@pytest.mark.parametrize("drafter", [None, OracleDrafter], ids=["model-drafter", "oracle"])
def test_sampled_with_drafts_follows_the_plain_distribution(v41, drafter, sampling, monkeypatch):
    """Chi-square goodness of fit of 3-token continuations (top-k 2: 8 outcomes) against the exact
    distribution; drafts are verified coupled (each row's plain draw) or by rejection sampling (model
    drafter: mostly rejected, so the residual path; oracle: a one-hot q, accepted with probability
    p(draft) either way)."""
    monkeypatch.setenv("DEEPINFER_SPEC_SAMPLED_VERIFY", sampling)
    prompt, n, steps = [0, 17, 99, 4], 160, 3
    params = [
        SamplingParams(temperature=2.0, top_k=2, max_tokens=steps, ignore_eos=True, seq_seed=1000 + i)
        for i in range(n)
    ]
    outs, engine = run(v41, params, nextn=2, drafter=drafter, prompts=[prompt] * n, max_num_seqs=160)
    counts = Counter(tuple(o.outputs[0].token_ids) for o in outs)
    exact = _exact_distribution(engine.model, prompt, steps, 2, 2.0)
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in exact.items())
    # df = 7, p = 0.01. Seeded, so deterministic; temperature 2 flattens the top-2 rows so that many
    # drafts are rejected (a residual bug, e.g. a 0.9 draft-prob penalty, gives chi2 ~ 22 here).
    assert chi2 < 18.48, (chi2, counts)
    assert engine.spec_stats()["verified"] > 0 and engine.spec.verifier.sampling == sampling


def test_async_scheduling_with_drafts_runs_the_synchronous_step(v41, plain):
    """Drafts for step N+1 come from the drafter after step N on the host, so the engine runs draft
    steps synchronously even with async_scheduling (documented); the tokens are the same."""
    spec, engine = run(v41, GREEDY, nextn=2, async_scheduling=True)
    assert engine.use_async and engine.num_speculative_tokens == 2
    assert tokens(spec) == plain


def test_async_scheduling_with_seeded_sampled_drafts_gives_the_sync_tokens(v41):
    """Seeded sampling with drafts (greedy, top-p and top-k rows in one batch): the asynchronous loop
    emits exactly the synchronous loop's tokens."""
    p = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seq_seed=5),
        SamplingParams(temperature=1.2, top_k=8, max_tokens=8, ignore_eos=True, seq_seed=6),
    ]
    sync, _ = run(v41, p, nextn=3, async_scheduling=False)
    asyn, engine = run(v41, p, nextn=3, async_scheduling=True)
    assert engine.use_async and engine.spec_stats()["verified"] > 0
    assert tokens(asyn) == tokens(sync)


def test_varlen_measures_the_step_time_curve_at_start(v41, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    args = EngineArgs(model=str(v41), block_size=16, max_model_len=48, max_num_seqs=2)
    engine = LLMEngine(args, num_speculative_tokens=3)
    curve = engine.spec.rule.curve
    assert engine.spec_stats()["varlen"] and curve.max_tokens == 2 * (1 + 3)
    assert all(ms > 0 for ms in curve.forward_ms)
    engine.close()


def test_stop_tokens_min_tokens_and_logprobs_with_accepted_drafts(v41, plain):
    """Oracle drafts are all accepted, so a stop token falls inside an accepted run of drafts: the
    output must end there exactly as without drafts (tokens after it are dropped), with the same
    logprobs (raw model log-probabilities of each verify row)."""
    stop = plain[0][0][4]
    p = SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[stop], logprobs=2, min_tokens=2)
    ref, _ = run(v41, p, prompts=PROMPTS[:1])
    spec, _ = run(v41, p, nextn=4, drafter=OracleDrafter, prompts=PROMPTS[:1])
    a, b = ref[0].outputs[0], spec[0].outputs[0]
    assert b.token_ids == a.token_ids and b.token_ids[-1] == stop and b.finish_reason == "stop"
    assert b.token_logprobs == pytest.approx(a.token_logprobs, abs=1e-4)
    assert [list(t) for t in b.top_logprobs] == [list(t) for t in a.top_logprobs]
