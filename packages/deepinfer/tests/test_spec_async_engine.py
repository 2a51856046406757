"""A drafting engine with the draft policy under async_scheduling (`SpecAsyncStep`): plain steps run in the
asynchronous loop, drafted ones synchronously, on the random-weight §11 tiny V4.1 (it has DSpark draft
blocks).

References: the same requests with drafts off, and through the synchronous speculative loop (`SpecStep`,
async_scheduling off); the stateless `ModelDrafter`'s drafts for the paged drafter's; recorded greedy
continuations for drafters that are always wrong or always right.
"""

import threading
from types import SimpleNamespace

import pytest
import torch
from deepinfer import SamplingParams
from deepinfer.engine import spec_decode, spec_step, worker
from deepinfer.engine.drafting import Drafts, ModelDrafter, OracleDrafter, PagedDrafter
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.spec_async_step import SpecAsyncStep
from deepinfer.engine.spec_step import SpecStep
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_spec import StepTimeCurve

PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42]]
NEXTN = 3
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-spec-async"), seed=0)


@pytest.fixture(autouse=True)
def varlen(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")


@pytest.fixture
def frozen_clock(monkeypatch):
    """Every time the engine measures for the draft policy is 0 (forward, sampler, draft forward, host work):
    its plans then depend on the given step-time curve alone, not on the machine's load, so two loops can
    be held to the same plans."""
    clock = SimpleNamespace(perf_counter=lambda: 0.0)
    for module in (worker, spec_decode, spec_step):
        monkeypatch.setattr(module, "time", clock)


def make_engine(path, nextn=NEXTN, async_scheduling=True, drafter=None, **kw) -> LLMEngine:
    """A decode step of 20 ms and 0.3 ms more per verified token (given, not measured)."""
    curve = StepTimeCurve([1, 64], [20.0, 20.0 + 0.3 * 63], mode="linear", extrapolate=True)
    kw.setdefault("max_model_len", 64)
    args = EngineArgs(model=str(path), block_size=16, async_scheduling=async_scheduling, **kw)
    engine = LLMEngine(args, num_speculative_tokens=nextn, step_time_curve=curve)
    if drafter is not None:
        engine.spec.drafter = drafter(engine)
    return engine


def run(engine, params, prompts=PROMPTS, each_step=None, prefix="r"):
    """Outputs in prompt order; the scheduler's invariants checked after every step; each_step(engine)
    after every step."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for j, (prompt, p) in enumerate(zip(prompts, plist)):
        engine.add_request(f"{prefix}{j}", None, p, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
        engine.scheduler.check_invariants()
        if each_step is not None:
            each_step(engine)
    return [outs[f"{prefix}{j}"] for j in range(len(prompts))]


def tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(v41):
    """Greedy tokens of PROMPTS with drafts off."""
    engine = make_engine(v41, nextn=0)
    out = tokens(run(engine, GREEDY))
    engine.close()
    return out


class Continuation:
    """Drafts from the recorded greedy continuation of each prompt: right, or shifted by one id (wrong)
    while `wrong()` says so."""

    def __init__(self, engine, plain, wrong, prompts=PROMPTS) -> None:
        self.full = [p + t for p, t in zip(prompts, plain)]
        self.vocab_size, self.wrong = engine.vocab_size, wrong

    def propose(self, requests):
        out = []
        for req in requests:
            seen = [*req.context, req.next_token]
            full = next(f for f in self.full if f[: len(seen)] == seen)
            drafts = full[len(seen) : len(seen) + req.num_drafts]
            drafts += [0] * (req.num_drafts - len(drafts))
            if self.wrong():
                drafts = [(t + 1) % self.vocab_size for t in drafts]
            out.append(Drafts(drafts, [0.9] * len(drafts)))
        return out


SAMPLED = [
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seq_seed=3, logprobs=2),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=1.2, top_k=8, max_tokens=24, ignore_eos=True, seq_seed=4),
]


@pytest.mark.parametrize("drafter", [None, OracleDrafter], ids=["paged-drafter", "oracle"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded-sampled"])
def test_tokens_and_logprobs_equal_the_synchronous_loop_and_drafts_off(v41, drafter, params):
    """Greedy and seeded sampled requests (coupled verification): the same tokens and logprobs as the
    synchronous speculative loop and as drafts off, with the checkpoint's random drafter (mostly
    plain steps, run ahead) and with the oracle (every greedy draft right)."""
    make = None if drafter is None else (lambda engine: drafter(engine.model))
    outputs = {}
    for name, nextn, async_scheduling in [("off", 0, True), ("sync", NEXTN, False), ("hybrid", NEXTN, True)]:
        engine = make_engine(v41, nextn, async_scheduling, drafter=make if nextn else None)
        outputs[name] = run(engine, params)
        if name == "sync":
            assert type(engine.strategy) is SpecStep
        if name == "hybrid":
            assert type(engine.strategy) is SpecAsyncStep and engine.pipeline is not None
            s = engine.spec_stats()
            assert s["verified"] > 0
            if drafter is None:  # the random drafter is rarely right: most steps run ahead
                assert s["async_steps"] > engine.stats.steps // 2, (s["async_steps"], engine.stats.steps)
        engine.close()
    for name in ("sync", "hybrid"):
        assert tokens(outputs[name]) == tokens(outputs["off"]), name
        for mine, ref in zip(outputs[name], outputs["off"]):
            assert mine.outputs[0].token_logprobs == ref.outputs[0].token_logprobs
            assert mine.outputs[0].finish_reason == ref.outputs[0].finish_reason


def test_a_wrong_drafter_runs_plain_steps_ahead_and_still_probes(v41, plain, frozen_clock):
    """Always-wrong drafts: after the warm-up the sequences back off and the steps run in the
    asynchronous loop (a step in flight between step() calls), probes still drafting at the policy's
    cadence, which is the synchronous loop's."""
    drafted = {}
    for async_scheduling in (False, True):
        engine = make_engine(
            v41, async_scheduling=async_scheduling, drafter=lambda e: Continuation(e, plain, lambda: True)
        )
        in_flight, per_step = [], []

        def each_step(engine, in_flight=in_flight, per_step=per_step):
            in_flight.append(engine.step_in_flight())
            per_step.append(engine.spec.policy.drafted)

        assert tokens(run(engine, GREEDY, each_step=each_step)) == plain
        s = engine.spec_stats()
        assert s["accepted"] == 0 and s["policy_probe_seq_steps"] >= 3
        assert engine.stats.steps == GREEDY.max_tokens  # one token per step, in either loop
        drafted[async_scheduling] = per_step
        if async_scheduling:
            assert s["async_steps"] >= GREEDY.max_tokens - 8 and sum(in_flight) >= GREEDY.max_tokens - 10
        else:
            assert s["async_steps"] == 0 and not any(in_flight)
        engine.close()
    # the same plans: who drafts after which step does not depend on the loop
    assert drafted[True] == drafted[False]


@pytest.mark.parametrize("chain", [False, True], ids=["host-filled", "device-fed"])
def test_paged_drafts_after_plain_steps_ahead_equal_the_stateless_drafts(v41, plain, chain):
    """The runner keeps the drafter keys of the steps run ahead: every paged draft, the ones proposed
    after a plain phase included, is the stateless drafter's; also where each plain step is launched
    before the one ahead of it is read back, its input ids taken on the device (`always_chain`: the
    GPU's path, on the CPU)."""

    class CrossCheck:
        def __init__(self, engine):
            self.engine = engine
            self.paged = PagedDrafter(engine.runner, engine.model)
            self.stateless = ModelDrafter(engine.model)
            self.checked = self.after_plain_phase = 0
            self.async_steps = 0

        def propose(self, requests):
            got, want = self.paged.propose(requests), self.stateless.propose(requests)
            for req, g, w in zip(requests, got, want):
                assert g.tokens == w.tokens and g.confidences == w.confidences, req.seq_id
            self.checked += len(requests)
            steps = self.engine.spec.async_steps
            self.after_plain_phase += len(requests) * (steps > self.async_steps + 1)
            self.async_steps = steps
            return got

    torch.set_num_threads(1)
    engine = make_engine(v41, drafter=CrossCheck)
    assert isinstance(engine.spec.drafter.paged, PagedDrafter)
    engine.pipeline.always_chain = chain
    assert tokens(run(engine, GREEDY)) == plain
    check = engine.spec.drafter
    assert check.checked > 0 and check.after_plain_phase > 0, (check.checked, check.after_plain_phase)
    assert (engine.pipeline.chained_launches > 0) == chain
    engine.close()


def test_a_drafter_right_after_a_plain_phase_has_every_draft_accepted(v41, plain):
    """Wrong drafts until the sequences have backed off and run ahead for a while, right ones from then
    on: the probes after the plain phase verify on the cache the steps run ahead wrote, and every one of
    their drafts is accepted (then the sequences draft again)."""
    state = {"wrong": True}
    engine = make_engine(v41, drafter=lambda e: Continuation(e, plain, lambda: state["wrong"]))
    marks = {}

    def each_step(engine):
        s = engine.spec_stats()
        if state["wrong"] and s["async_steps"] >= 6:
            state["wrong"] = False
            marks["switch"] = (s["verified"], s["accepted"], s["async_steps"])

    assert tokens(run(engine, GREEDY, each_step=each_step)) == plain
    s = engine.spec_stats()
    verified, accepted, _ = marks["switch"]
    assert s["verified"] - verified > 0 and s["accepted"] - accepted == s["verified"] - verified
    engine.close()


def test_aborts_in_either_phase(v41, plain, engine_clean):
    """An abort while a plain step is in flight (wrong drafter: plain steps ahead) and one while the
    drafted steps run (right drafter: synchronous steps); the other requests get their tokens, the aborted
    ones finish "abort", every block comes back; abort_all with a step in flight settles it."""
    for wrong, when in ((True, lambda e: e.step_in_flight()), (False, lambda e: e.strategy._drafts_fed)):
        engine = make_engine(v41, drafter=lambda e, w=wrong: Continuation(e, plain, lambda: w))
        aborted = []

        def each_step(engine, when=when, aborted=aborted):
            if not aborted and engine.stats.steps >= 3 and when(engine):
                aborted.append(engine.abort_request("r1"))

        outs = run(engine, GREEDY, each_step=each_step)
        assert aborted == [True]
        assert outs[1].outputs[0].finish_reason == "abort"
        assert outs[1].outputs[0].token_ids == plain[1][: len(outs[1].outputs[0].token_ids)]
        assert tokens([outs[0], outs[2]]) == [plain[0], plain[2]]
        engine_clean(engine)
        if wrong:  # abort_all with a step in flight; the engine serves on
            for j, prompt in enumerate(PROMPTS):
                engine.add_request(f"x{j}", None, GREEDY, prompt_token_ids=prompt)
            while not (engine.stats.steps >= 40 and engine.step_in_flight()):
                engine.step()
            done = engine.abort_all()
            assert sorted(o.request_id for o in done) == ["x0", "x1", "x2"]
            assert all(o.outputs[0].finish_reason == "abort" for o in done)
            engine_clean(engine)
            assert tokens(run(engine, GREEDY, prefix="y")) == plain
            engine_clean(engine)
        engine.close()


def test_a_step_error_in_a_plain_phase_fails_only_its_requests(v41, plain, engine_clean):
    """The sampler raises once on the model thread (a plain step run ahead): the requests of that step
    fail, naming it; a request waiting meanwhile (max_num_seqs 2) then gets its tokens; the engine
    serves the next batch with the right tokens."""
    engine = make_engine(v41, drafter=lambda e: Continuation(e, plain, lambda: True), max_num_seqs=2)
    real, calls = engine.worker.sampler, [0]

    def sampler(*args, **kwargs):
        if threading.current_thread().name == "deepinfer-model":
            calls[0] += 1
            if calls[0] == 12:
                raise RuntimeError("injected into the sampler")
        return real(*args, **kwargs)

    engine.worker.sampler = sampler
    outs = run(engine, GREEDY)
    assert calls[0] > 12
    assert [o.error is not None for o in outs] == [True, True, False], [o.error for o in outs]
    assert all("model step failed" in o.error and "injected" in o.error for o in outs[:2])
    assert tokens(outs[2:]) == plain[2:]
    engine_clean(engine)
    engine.worker.sampler = real
    assert tokens(run(engine, GREEDY, prefix="again")) == plain
    assert engine.spec_stats()["async_steps"] > 0
    engine_clean(engine)
    engine.close()


def test_preemption_while_plain_steps_run_ahead(v41, frozen_clock):
    """A KV pool too small for both sequences: schedules made while a step is in flight preempt, the
    preempted sequence recomputes and starts over in the draft policy (a new sequence, as in the
    synchronous loop); the tokens are those of drafts off and every block comes back. (The clock is frozen:
    when the policy backs off, and so whether the loop runs ahead at the preemption, must not depend on
    the machine's load.)"""
    # a second block each after 10 tokens (3 blocks exist): past the first drafting steps, while the wrong
    # drafter's sequences have backed off and plain steps run ahead, before the first probe
    prompts = [list(range(40, 46)), list(range(90, 96))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref_engine = make_engine(v41, nextn=0, num_kv_blocks=3, max_model_len=48)
    ref = tokens(run(ref_engine, params, prompts=prompts))
    ref_engine.close()
    engine = make_engine(
        v41,
        num_kv_blocks=3,
        max_model_len=48,
        drafter=lambda e: Continuation(e, ref, lambda: True, prompts),  # wrong: backs off early
    )
    discarded, real = [], engine.spec.discard

    def discard(seq_id):
        discarded.append((seq_id, engine.step_in_flight()))
        real(seq_id)

    engine.spec.discard = discard
    assert tokens(run(engine, params, prompts=prompts)) == ref
    stats = engine.scheduler_stats()
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert any(in_flight for _, in_flight in discarded), discarded  # preempted by a schedule made ahead
    assert all(seq_id not in engine.spec.policy._seqs for seq_id, _ in discarded)
    engine.close()
