"""The draft policy is asked who drafts before any `DraftRequest` is built: a sequence it skips costs no
request (no copy of its context, no sampling params), and the decisions and tokens are those of building
every request first and letting the policy filter them.

The random-weight §11 tiny V4.1 and its own (untrained) drafter, MTP varlen on with a fixed step-time
curve. The engine's clocks are frozen (every measured time 0) so that the policy's decisions depend only
on the curve and on which drafts were accepted, not on the machine: its counters are then a property of
the code, and `FROZEN_CLOCK_COUNTERS` are the ones the engine gave when it built every request first.
"""

from types import SimpleNamespace

import pytest
from deepinfer import SamplingParams
from deepinfer.engine import spec_decode, spec_step, worker
from deepinfer.engine.drafting import DraftRequest
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_spec import StepTimeCurve

PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42], [9, 1]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seq_seed=3),
    SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
    SamplingParams(temperature=1.2, top_k=8, max_tokens=30, ignore_eos=True, seq_seed=5),
]
NEXTN = 3
# policy summary of this run when every decoding sequence's DraftRequest was built before the policy chose
FROZEN_CLOCK_COUNTERS = {
    "steps": 29,
    "request_steps": 98,
    "verified": 51,
    "accepted": 0,
    "policy_drafted_seq_steps": 19,
    "policy_skipped_seq_steps": 75,
    "policy_probe_seq_steps": 7,
    "policy_deferred_probe_seq_plans": 0,
}


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-lazy"), seed=0)


@pytest.fixture
def frozen_clock(monkeypatch):
    """Every time the engine measures for the policy is 0 (forward, sampler, draft forward, host work)."""
    clock = SimpleNamespace(perf_counter=lambda: 0.0)
    for module in (worker, spec_decode, spec_step):
        monkeypatch.setattr(module, "time", clock)


class CountingRequest(DraftRequest):
    built = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        CountingRequest.built += 1


class RecordingDrafter:
    """The engine's own drafter; records the requests it is given."""

    def __init__(self, inner) -> None:
        self.inner, self.seen = inner, []
        if hasattr(inner, "draft_forwards"):
            self.draft_forwards = inner.draft_forwards

    def propose(self, requests):
        self.seen.extend(requests)
        return self.inner.propose(requests)


def run(path, tmp_path, nextn):
    curve = tmp_path / "curve.json"
    StepTimeCurve([1, 64], [20.0, 20.0 + 0.3 * 63], mode="linear", extrapolate=True).save(curve)
    args = EngineArgs(model=str(path), block_size=16, max_model_len=48)
    engine = LLMEngine(args, num_speculative_tokens=nextn, step_time_curve=curve)
    if engine.spec is not None:
        engine.spec.drafter = RecordingDrafter(engine.spec.drafter)
    for j, (prompt, p) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(str(j), None, p, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    engine.close()
    return [list(outs[str(j)].outputs[0].token_ids) for j in range(len(PROMPTS))], engine


def test_requests_are_built_only_for_the_drafting_sequences(v41, tmp_path, monkeypatch, frozen_clock):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    monkeypatch.setattr(spec_step, "DraftRequest", CountingRequest)
    CountingRequest.built = 0
    plain, _ = run(v41, tmp_path, 0)
    tokens, engine = run(v41, tmp_path, NEXTN)
    assert tokens == plain  # greedy and seeded sampled alike (coupled verification)
    s = engine.spec.summary()
    assert s["policy_skipped_seq_steps"] > 0 and s["policy_drafted_seq_steps"] > 0
    # a request per drafting sequence-step, every one of them handed to the drafter
    seen = engine.spec.drafter.seen
    assert CountingRequest.built == s["policy_drafted_seq_steps"] == len(seen)
    assert all(type(r) is CountingRequest for r in seen)
    # each request is what the sequence had when it was built: its tokens so far, drafts within its room
    full = {j: PROMPTS[j] + tokens[j] for j in range(len(PROMPTS))}
    for r in seen:
        j = next(j for j in full if full[j][: len(r.context) + 1] == [*r.context, r.next_token])
        room = len(PROMPTS[j]) + PARAMS[j].max_tokens - len(r.context) - 1
        assert r.num_drafts == min(NEXTN, room - 1) and r.params.temperature == PARAMS[j].temperature
    assert {k: s[k] for k in FROZEN_CLOCK_COUNTERS} == FROZEN_CLOCK_COUNTERS
