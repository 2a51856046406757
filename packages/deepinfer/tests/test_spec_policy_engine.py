"""The adaptive draft policy (MTP varlen on) in the engine loop, on the random-weight §11 tiny V4.1.

References: the same engine's greedy tokens with drafts off. Two drafters from those tokens: one that
proposes exactly them (every draft right, and cheap, unlike the stateless `OracleDrafter`, whose k
extra forwards are not what a drafter costs) and one that proposes other tokens (every draft wrong).
"""

import time

import pytest
from deepinfer import SamplingParams
from deepinfer.engine.drafting import Drafts, RecordedDrafter
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_spec import StepTimeCurve

PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42]]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
NEXTN = 3
MEASURED_PLAIN_STEPS = 3  # once a few drafted steps are timed, the draft policy times as many plain ones


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-policy"), seed=0)


@pytest.fixture
def varlen(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")


def run(path, nextn=0, drafter=None, curve=None, params=GREEDY, **kw):
    """Tokens per prompt, the engine (its completions in `engine.outputs`), and the policy's drafted
    sequence-steps after each step."""
    args = EngineArgs(model=str(path), block_size=16, max_model_len=48, **kw)
    engine = LLMEngine(args, num_speculative_tokens=nextn, step_time_curve=curve)
    if drafter is not None:
        engine.spec.drafter = drafter(engine)
    plist = params if isinstance(params, list) else [params] * len(PROMPTS)
    for j, (prompt, p) in enumerate(zip(PROMPTS, plist)):
        engine.add_request(str(j), None, p, prompt_token_ids=prompt)
    outs, drafted = {}, []
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
        if engine.spec is not None and engine.spec.policy is not None:
            drafted.append(engine.spec.policy.drafted)
    engine.close()
    engine.outputs = [outs[str(j)].outputs[0] for j in range(len(PROMPTS))]
    return [list(o.token_ids) for o in engine.outputs], engine, drafted


@pytest.fixture(scope="module")
def plain(v41):
    tokens, _, _ = run(v41)
    return tokens


def recorded(plain: list[list[int]]) -> list[list[int]]:
    """Each prompt followed by its greedy tokens with drafts off: what `RecordedDrafter` drafts from."""
    return [p + t for p, t in zip(PROMPTS, plain)]


class NoDrafter:
    def propose(self, requests):
        return [Drafts([], []) for _ in requests]


def test_steps_without_drafts_emit_the_plain_tokens_for_sampled_requests(v41):
    """A drafted engine's steps in which nobody verifies drafts are plain steps: seeded sampled (and
    greedy) requests get exactly the tokens of the engine with drafts off, logprobs too."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, seq_seed=3, logprobs=2),
        SamplingParams(temperature=1.3, top_k=5, max_tokens=12, ignore_eos=True, seq_seed=4),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
    ]
    ref, plain_engine, _ = run(v41, params=params)
    tokens, engine, _ = run(v41, nextn=NEXTN, drafter=lambda engine: NoDrafter(), params=params)
    assert tokens == ref
    for mine, theirs in zip(engine.outputs, plain_engine.outputs):
        assert mine.logprobs == theirs.logprobs
    s = engine.spec_stats()
    assert s["verified"] == 0 and s["request_steps"] == 3 * 11


def decode_curve(tmp_path):
    """A decode step's time: 20 ms, and 0.3 ms more per verified token."""
    path = tmp_path / "curve.json"
    StepTimeCurve([1, 64], [20.0, 20.0 + 0.3 * 63], mode="linear", extrapolate=True).save(path)
    return path


def test_the_policy_is_on_by_default(v41, monkeypatch):
    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN")
    engine = LLMEngine(
        EngineArgs(model=str(v41), block_size=16, max_model_len=48, max_num_seqs=2), num_speculative_tokens=2
    )
    assert engine.spec.policy is not None and engine.spec_stats()["varlen"]
    # the measured curve prices batches beyond its largest size
    assert engine.spec.rule.curve.extrapolate and engine.spec.policy.step_ms(1000, 200) is not None
    engine.close()


def test_policy_keeps_greedy_outputs_with_the_model_drafter(v41, plain, varlen):
    tokens, engine, _ = run(v41, nextn=NEXTN)
    s = engine.spec_stats()
    assert s["varlen"] and s["policy_drafted_seq_steps"] > 0
    assert tokens == plain


def test_an_always_wrong_drafter_stops_drafting_after_the_warm_up(v41, plain, varlen, tmp_path):
    def wrong(engine):
        return RecordedDrafter(recorded(plain), engine.vocab_size, wrong=True)

    tokens, engine, drafted = run(v41, nextn=NEXTN, drafter=wrong, curve=decode_curve(tmp_path))
    assert tokens == plain
    s = engine.spec_stats()
    assert s["accepted"] == 0 and s["policy_drafted_seq_steps"] == drafted[-1]
    assert s["policy_drafted_seq_steps"] + s["policy_skipped_seq_steps"] >= 3 * 25
    assert engine.stats.steps == 1 + GREEDY.max_tokens - 1  # nothing accepted: one token per step
    # after a warm-up of a few drafted steps, only probes draft: at doubling intervals, 3 sequences each
    warm_up = 8
    late = [b - a for a, b in zip(drafted[warm_up:], drafted[warm_up + 1 :])]
    assert sum(1 for d in late if d) <= 2 and sum(late) <= 3 * 2
    assert sum(1 for d in late if d == 0) >= len(late) - 2
    assert s["policy_probe_seq_steps"] >= 3  # it keeps measuring


def test_a_right_drafter_keeps_drafting_at_full_length(v41, plain, varlen, tmp_path):
    def right(engine):
        return RecordedDrafter(recorded(plain), engine.vocab_size, wrong=False)

    tokens, engine, drafted = run(v41, nextn=NEXTN, drafter=right, curve=decode_curve(tmp_path))
    assert tokens == plain
    s = engine.spec_stats()
    # the only steps without drafts: the few plain ones the policy runs to time plain steps (3 sequences)
    assert s["policy_skipped_seq_steps"] == 3 * MEASURED_PLAIN_STEPS and s["policy_probe_seq_steps"] == 0
    assert engine.spec.policy.timed_plans[False] == MEASURED_PLAIN_STEPS
    assert s["accept_rate_per_position"] == [1.0] * NEXTN
    # after every step each sequence drafts, but in the measuring steps (after the first 3 drafted
    # ones), until max_tokens leaves no room for a draft (1 token left, then the last step): 29 tokens
    # after the prefill's first are 3 steps of 4, 3 of 1, 4 of 4 (the last one cut to 2 by max_tokens)
    assert drafted == [3, 6, 9, 9, 9, 9, 12, 15, 18, 21, 21], drafted
    # full blocks: the prefill step, then 1 + k tokens per step until max_tokens leaves less room
    assert (
        s["verified"] == s["accepted"] and s["verified"] / drafted[-1] > NEXTN - 0.5
    )  # per drafting seq-step
    assert engine.stats.steps <= 1 + -(-(GREEDY.max_tokens - 1) // (1 + NEXTN)) + 1 + MEASURED_PLAIN_STEPS


class SlowDrafter(RecordedDrafter):
    """A drafter whose forward takes 50 ms more: the draft forward the policy prices on its own."""

    def propose(self, requests):
        time.sleep(0.05)
        return super().propose(requests)


def test_the_policy_prices_the_host_work_of_plain_and_verification_steps(v41, plain, varlen, tmp_path):
    def wrong(engine):
        return SlowDrafter(recorded(plain), engine.vocab_size, wrong=True)

    # the synchronous speculative loop: every decode step's host work is on the critical path (with
    # async_scheduling, plain steps run ahead in the asynchronous loop, whose host work is hidden)
    tokens, engine, _ = run(
        v41, nextn=NEXTN, drafter=wrong, curve=decode_curve(tmp_path), async_scheduling=False
    )
    assert tokens == plain
    policy = engine.spec.policy
    # decode steps of both kinds were measured, each over its rows: a plain one has one per sequence
    plain_rows = [m for m, _ in policy.plain_host.samples]
    verify_rows = [m for m, _ in policy.verify_host.samples]
    assert plain_rows and verify_rows and max(plain_rows) <= len(PROMPTS) < max(verify_rows)
    assert len(plain_rows) + len(verify_rows) == engine.stats.steps - 1  # all but the prefill step
    # the host work excludes the draft forward (50 ms of sleep each time the drafter ran)
    recorded_ms = sum(ms for _, ms in policy.plain_host.samples) + sum(
        ms for _, ms in policy.verify_host.samples
    )
    host_ms = 1e3 * (engine.stats.prepare_s + engine.stats.process_s - engine.spec.draft_s)
    assert engine.spec.draft_s > 0.05 and 0 < recorded_ms <= host_ms + 1e-6


def test_the_policy_times_its_steps_and_backs_off_where_a_curve_overstates_them(v41, plain, varlen, tmp_path):
    """A step-time curve that says 1 s where a step takes milliseconds (measured on another path than the
    engine's steps, as an eager curve against graphed GPU steps): on it, a never-right drafter's draft
    forward and verification look free, and without timing the policy drafts on nearly every step. Timed
    on the wall clock (the default), drafted and plain steps both cost far less than the curve says, the
    drafted ones more: it backs off to probes."""
    path = tmp_path / "slow_curve.json"
    StepTimeCurve([1, 64], [1000.0, 1000.0 + 0.3 * 63], mode="linear", extrapolate=True).save(path)

    def wrong(engine):
        return RecordedDrafter(recorded(plain), engine.vocab_size, wrong=True)

    def untimed(engine):
        engine.spec.policy.clock = None
        return wrong(engine)

    runs = {}
    for name, drafter in (("timed", wrong), ("untimed", untimed)):
        tokens, engine, drafted = run(v41, nextn=NEXTN, drafter=drafter, curve=path, async_scheduling=False)
        assert tokens == plain
        late = [b - a for a, b in zip(drafted[10:], drafted[11:])]  # sequences drafting per late step
        runs[name] = (sum(1 for d in late if d), len(late), engine.spec_stats())
    timed_steps, n, stats = runs["timed"]
    untimed_steps, _, untimed_stats = runs["untimed"]
    assert untimed_steps >= n - 3 and untimed_stats["policy_wall_ratio_draft"] is None
    # probes only: each of the 3 sequences probes at most twice in these 19 steps (its back-off doubling
    # from 4), on one schedule or, where timing parts them and the budget does not group them, on its own
    assert timed_steps <= 2 * 3 < n - 3, runs
    # (steps take milliseconds, tens on a loaded machine: far below the curve's 1,000)
    assert stats["policy_wall_ratio_plain"] < 0.5 and stats["policy_wall_ratio_draft"] < 0.5
    assert stats["policy_wall_ratio_draft"] > stats["policy_wall_ratio_plain"]
