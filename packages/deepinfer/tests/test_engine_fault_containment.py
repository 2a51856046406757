"""A fault at any stage of a step (building it, the forward, sampling or verification, the scheduler's
commit, detokenizing, a grammar) fails the requests it concerns and nothing else: no exception leaves the
engine, the C++ scheduler's invariants hold after every step, every block is free after the batch, and
the next batch gives exactly the tokens of a run without the fault. Checked in the synchronous, the
asynchronous and the speculative (DSpark drafts) loops.

Faults are injected by making one stage function raise on one call; everything else is the real engine.
"""

import pytest
from deepinfer import SamplingParams, detokenizer
from deepinfer.engine import scheduling
from deepinfer.engine import worker as worker_module
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.structured import StructuredOutputs
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

PROMPTS = [
    [0, 40, 77, 91, 12, 200, 5],
    [0, 7, 7, 8, 9],
    [0, 150, 33, 98, 140, 21, 66, 71, 250],
]  # < 256: the V4.1 vocabulary
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seq_seed=5),
    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
]


class Fault(RuntimeError):
    pass


def arm(monkeypatch, owner, name: str, first: int, count: int = 1) -> list[int]:
    """`owner.name` raises `Fault` on its calls number first .. first + count - 1 (1-based); the returned
    list holds the number of calls made so far."""
    real = getattr(owner, name)
    calls = [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if first <= calls[0] < first + count:
            raise Fault(f"injected into {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)
    return calls


def run(engine, prompts=PROMPTS, params=PARAMS):
    """The batch through `engine.step()`, the scheduler's invariants checked after every step."""
    for j, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"q{run.counter}-{j}", None, p, prompt_token_ids=prompt)
    order = [f"q{run.counter}-{j}" for j in range(len(prompts))]
    run.counter += 1
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        engine.scheduler.check_invariants()
    return [outs[r] for r in order]


run.counter = 0


@pytest.fixture(scope="module")
def v41_path(tmp_path_factory):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-faults"), seed=0)


LOOPS = ["sync", "async", "spec"]


@pytest.fixture(scope="module", params=LOOPS)
def loop(request, micro_checkpoint, share_loaded_models):
    """(name, engine, reference outputs of a run without faults)."""
    if request.param == "spec":
        v41 = request.getfixturevalue("v41_path")
        engine = LLMEngine(
            EngineArgs(model=str(v41), block_size=16, max_model_len=48), num_speculative_tokens=2
        )
    else:
        args = EngineArgs(
            model=str(micro_checkpoint),
            block_size=16,
            max_model_len=64,
            async_scheduling=request.param == "async",
        )
        engine = LLMEngine(args)
    reference = [o.outputs[0].token_ids for o in run(engine)]
    assert all(len(t) == p.max_tokens for t, p in zip(reference, PARAMS))
    yield request.param, engine, reference
    engine.close()


def _stage_targets(name: str, engine):
    """(owner, attribute, calls that raise, message of the failed requests, whether some request must fail)."""
    spec = name == "spec"
    return {
        "prepare": (engine.strategy, "_prepare", 1, "prepare failed", True)
        if spec
        else (engine.builder, "step", 1, "prepare failed", True),
        # the batch forward and its retry sequence by sequence: every forward of the step fails
        "forward": (engine.runner, "execute", 1 + len(PROMPTS), "forward failed", True),
        "forward_once": (engine.runner, "execute", 1, None, False),  # the retry one by one serves the step
        "sample": (worker_module, "verify_logits", 1, "model step failed", True)
        if spec
        else (engine.worker, "sampler", 1, "model step failed", True),
        "update": (scheduling, "update_from_lists", 1, "output processing failed", True)
        if spec
        else (scheduling, "update_from_output", 1, "update failed", True),
        "detokenize": (detokenizer.IncrementalDetokenizer, "add", 1, "output processing failed", True),
    }


STAGES = ["prepare", "forward", "forward_once", "sample", "update", "detokenize"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("when", [1, 3])  # the stage's first call, and one in mid-decode
def test_a_fault_fails_its_requests_and_the_engine_serves_on(loop, stage, when, monkeypatch, engine_clean):
    name, engine, reference = loop
    owner, attr, count, message, must_fail = _stage_targets(name, engine)[stage]
    if stage.startswith("forward") and when == 3:
        when = 2  # the second step's forward (the first step succeeded in one call)
    with monkeypatch.context() as m:
        calls = arm(m, owner, attr, when, count)
        outs = run(engine)
    assert calls[0] >= when, f"the fault never fired ({calls[0]} calls)"
    failed = [o for o in outs if o.error is not None]
    assert bool(failed) == must_fail, [o.error for o in outs]
    for o, ref in zip(outs, reference):
        got = o.outputs[0].token_ids
        if o.error is None:
            assert got == ref
        else:
            assert message in o.error and "injected" in o.error, o.error
            assert got == ref[: len(got)]  # what it emitted before the fault is what it would have
    engine_clean(engine)
    assert [o.outputs[0].token_ids for o in run(engine)] == reference
    engine_clean(engine)


# ---------------------------------------------------------------------------- grammars
SO = {"schema_type": "regex", "schema": "(yes|no)(, (yes|no))*"}


@pytest.fixture(scope="module", params=["sync", "async"])
def structured_loop(request, real_vocab_checkpoint, share_loaded_models):
    args = EngineArgs(
        model=str(real_vocab_checkpoint),
        block_size=16,
        max_model_len=64,
        async_scheduling=request.param == "async",
    )
    engine = LLMEngine(args)
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=6, seq_seed=3, so_args=SO),
        SamplingParams(temperature=0.0, max_tokens=6, so_args=SO),
    ]
    reference = [o.outputs[0].token_ids for o in run(engine, params=params)]
    yield engine, params, reference
    engine.close()


@pytest.mark.parametrize(
    "attr,message,plain_may_fail",
    [
        ("accept", "structured output", False),  # committing a token to one grammar: that request alone
        ("allowed_rows", "model step failed", True),  # the step's mask fill: the step's requests
    ],
)
def test_a_grammar_fault_is_contained(
    structured_loop, attr, message, plain_may_fail, monkeypatch, engine_clean
):
    engine, params, reference = structured_loop
    with monkeypatch.context() as m:
        calls = arm(m, StructuredOutputs, attr, 2)
        outs = run(engine, params=params)
    assert calls[0] >= 2
    failed = [i for i, o in enumerate(outs) if o.error is not None]
    assert failed and (plain_may_fail or 0 not in failed), [o.error for o in outs]
    if not plain_may_fail:
        assert len(failed) == 1
    for i, (o, ref) in enumerate(zip(outs, reference)):
        got = o.outputs[0].token_ids
        if i in failed:
            assert message in o.error and got == ref[: len(got)], o.error
        else:
            assert got == ref
    engine_clean(engine)
    assert [o.outputs[0].token_ids for o in run(engine, params=params)] == reference
    engine_clean(engine)
