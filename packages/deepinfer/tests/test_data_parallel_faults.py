"""A fault on one data-parallel rank under DP 2 x EP 2 (2 CPU processes, gloo): the rank's step fails its
own requests, naming the stage, and still joins the expert all-to-alls the other rank's forward needs —
with an idle forward when the fault came before its forward ran (`StepStrategy._recover`), by finishing
the all-to-alls of the layers a failed forward never reached otherwise. The other rank's requests end
exactly as alone, both ranks serve the next batch, and every block is free after.

Each rank runs the real engine of a spawned rank (`rank_process.rank_engine`) and the rank loop's
stepping (step until no rank of the EP group has work); the fault is one call of a stage function
made to raise in rank 1's process.
"""

import json

import pytest
import torch
from deepinfer import SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.rank_process import rank_engine
from deepinfer.engine_args import EngineArgs
from deepinfer_parallel.launch import run_distributed

pytestmark = pytest.mark.distributed

PROMPTS = [[1, 2, 3, 4, 5], [9, 10, 11], [30, 31, 32, 33], [40, 41]]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seq_seed=7),
] * 2
ON_RANK = {0: [0, 1], 1: [2, 3]}  # request indices each rank serves
ENGINE = dict(block_size=16, max_model_len=64)


def _args(ckpt: str, loop: str, **kw) -> EngineArgs:
    return EngineArgs(model=ckpt, async_scheduling=loop == "async", **ENGINE, **kw)


def _arm(owner, name: str, at_call: int) -> None:
    """`owner.name` raises on its call number `at_call` (1-based), once."""
    real, calls = getattr(owner, name), [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError(f"injected into {name}")
        return real(*args, **kwargs)

    setattr(owner, name, faulty)


def _serve(engine, dp, indices: list[int], tag: str) -> dict[int, tuple]:
    """The rank loop's stepping over this rank's requests: steps until no rank of the group has work.
    Returns {request index: (error, token ids)}."""
    for i in indices:
        engine.add_request(f"{tag}{i}", None, PARAMS[i], prompt_token_ids=PROMPTS[i])
    outs = {}
    while True:
        for o in engine.step():
            outs[int(o.request_id[len(tag) :])] = (o.error, o.outputs[0].token_ids if o.outputs else [])
        engine.scheduler.check_invariants()
        if not dp.any_busy:
            break
    dp.wait_idle_forwards()
    return outs


def _assert_clean(engine) -> None:
    assert not engine.has_unfinished_requests() and engine.scheduler.num_inflight_steps == 0
    engine.scheduler.check_invariants()
    stats = engine.scheduler_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats


def _faulty_rank_worker(rank, world, ckpt, loop, stage, solo_path):
    solo = json.loads(open(solo_path).read())
    engine, dp = rank_engine(
        _args(ckpt, loop, data_parallel_size=2, expert_parallel_size=2), torch.device("cpu")
    )
    try:
        if rank == 1:  # its second step (the first decode of both its requests) fails
            owner, name = (engine.builder, "step") if stage == "prepare" else (engine.runner, "execute")
            _arm(owner, name, at_call=2)
        got = _serve(engine, dp, ON_RANK[rank], "a")
        for i in ON_RANK[rank]:
            error, tokens = got[i]
            if rank == 0:
                assert error is None and tokens == solo[i], (rank, i, error, tokens)
            else:
                message = "prepare failed" if stage == "prepare" else "model forward failed"
                assert error is not None and message in error and "injected" in error, error
                assert tokens == solo[i][: len(tokens)], tokens
                # the first step's token is emitted, except where the async loop fails the requests
                # as the step after it fails to build, before the first step is committed
                assert len(tokens) == (0 if (loop, stage) == ("async", "prepare") else 1), tokens
        _assert_clean(engine)
        again = _serve(engine, dp, ON_RANK[rank], "b")  # the next batch, no fault
        assert {i: again[i] for i in ON_RANK[rank]} == {i: (None, solo[i]) for i in ON_RANK[rank]}
        _assert_clean(engine)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def solo(micro_checkpoint, tmp_path_factory):
    """Each request alone on the single-process engine (DP x EP gives its tokens bitwise)."""
    engine = LLMEngine(_args(str(micro_checkpoint), "sync"))
    out = []
    for i, (prompt, p) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(str(i), None, p, prompt_token_ids=prompt)
        done = []
        while engine.has_unfinished_requests():
            done += engine.step()
        out.append(done[0].outputs[0].token_ids)
    engine.close()
    path = tmp_path_factory.mktemp("dp-faults") / "solo.json"
    path.write_text(json.dumps(out))
    return str(path)


@pytest.mark.parametrize("stage", ["prepare", "forward"])
@pytest.mark.parametrize("loop", ["sync", "async"])
def test_a_fault_on_one_rank_fails_its_step_and_the_world_serves_on(micro_checkpoint, solo, loop, stage):
    run_distributed(_faulty_rank_worker, 2, str(micro_checkpoint), loop, stage, solo, timeout_s=60)
