"""Routing requests over data-parallel ranks (engine/dp_balance.py, engine/data_parallel.py) on 2 CPU
processes (gloo): every policy gives the single-process engine's outputs (greedy, and sampled with the
front's seed stream), a shared-prefix group lands on one rank under the balanced policy, and waiting
requests that an overloaded rank had not started move to the other rank without changing any output.

Requests without seq_seed draw their seeds from the engine's stream in arrival order, so each engine
here runs its workloads in the order its reference did: the tests run in the order they are written.
"""

import dataclasses
import time

import pytest
from deepinfer import LLM, SamplingParams

from .test_data_parallel import assert_same

pytestmark = pytest.mark.distributed

SHARED = list(range(100, 164))  # 4 blocks of 16
GROUP = [SHARED + [200 + i, 3 + i, 4] for i in range(6)]
FILLERS = [list(range(1, 30)), [3, 4], [7, 8, 9, 10, 11], [12, 40, 41] * 4, [500, 2, 77]]
PROMPTS = GROUP + FILLERS
GREEDY = [SamplingParams(temperature=0, max_tokens=3 + i % 4, ignore_eos=True, logprobs=1) for i in range(11)]
# without seq_seed: the seeds come from the front's stream in request order, wherever a request runs
SAMPLED = [
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3 + i % 3, ignore_eos=True) for i in range(11)
]
# the move test: one sequence at a time per rank, so requests wait; the first request of each rank
# (equal costs alternate between the ranks) is long enough to hold its rank past the first step()
MOVE_PROMPTS = [[5 + i, 6, 7, 8, 9 + i] for i in range(8)]
MOVE_PARAMS = [
    SamplingParams(temperature=0.7 if i % 4 == 0 else 0.0, max_tokens=200 if i < 2 else 40, ignore_eos=True)
    for i in range(8)
]


def _generate(llm, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(micro_checkpoint):
    """Single-process outputs: of an engine that ran the move workload first (as `balanced` does) and of
    a fresh one."""
    out = {}
    with LLM(str(micro_checkpoint), async_scheduling=False) as llm:
        out["move"] = _generate(llm, MOVE_PROMPTS, MOVE_PARAMS)
        out["after_move"] = {
            "greedy": _generate(llm, PROMPTS, GREEDY),
            "sampled": _generate(llm, PROMPTS, SAMPLED),
        }
    with LLM(str(micro_checkpoint), async_scheduling=False) as llm:
        out["fresh"] = {
            "greedy": _generate(llm, PROMPTS, GREEDY),
            "sampled": _generate(llm, PROMPTS, SAMPLED),
        }
    return out


@pytest.fixture(scope="module")
def balanced(micro_checkpoint):
    # EP 2: the ranks vote every step, so moves must keep their message counts equal
    with LLM(
        str(micro_checkpoint), data_parallel_size=2, expert_parallel_size=2, dp_routing="balanced",
        max_num_seqs=1, distributed_timeout=60,
    ) as llm:  # fmt: skip
        yield llm


def _check_outputs(llm, reference) -> None:
    assert_same(_generate(llm, PROMPTS, GREEDY), reference["greedy"])
    assert_same(_generate(llm, PROMPTS, SAMPLED), reference["sampled"])


def test_waiting_requests_move_off_an_overloaded_rank_with_the_same_outputs(balanced, reference):
    engine = balanced.engine
    # no slack: the gap this small test leaves (a few hundred tokens) is enough to move requests
    config = engine.router.config
    engine.router.config = dataclasses.replace(config, slack_tokens=0)
    moved_before = engine.routing_stats()["moved_requests"]
    for i, (prompt, params) in enumerate(zip(MOVE_PROMPTS, MOVE_PARAMS)):
        engine.add_request(f"m{i}", None, params, prompt_token_ids=prompt)
    outs = {o.request_id: o for o in engine.step()}  # dispatches: 4 per rank, 1 running on each
    assert not outs
    # the ranks' requests are split evenly; aborting one rank's leaves the other overloaded with
    # requests it has not started
    on_one = [f"m{i}" for i in range(8) if engine.routed_rank(f"m{i}") == 1]
    assert on_one == ["m1", "m3", "m5", "m7"]
    for rid in on_one:
        assert engine.abort_request(rid)
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        outs.update((o.request_id, o) for o in engine.step())
    assert not engine.has_unfinished_requests()
    assert engine.routing_stats()["moved_requests"] > moved_before
    kept = [i for i in range(8) if f"m{i}" not in on_one]
    assert_same([outs[f"m{i}"] for i in kept], [reference["move"][i] for i in kept])
    assert all(outs[rid].outputs[0].finish_reason == "abort" for rid in on_one)
    engine.router.config = config


def test_balanced_routing_gives_the_single_process_outputs(balanced, reference):
    _check_outputs(balanced, reference["after_move"])
    assert balanced.engine.routing_stats()["policy"] == "balanced"
    assert all(s["generated_tokens"] > 0 for s in balanced.engine._rank_stats)


@pytest.mark.parametrize("policy", ["static", "round_robin"])
def test_static_and_round_robin_give_the_single_process_outputs(
    micro_checkpoint, reference, policy, monkeypatch
):
    monkeypatch.setenv("DEEPINFER_DP_ROUTING", policy)  # the environment picks the policy
    with LLM(str(micro_checkpoint), data_parallel_size=2, distributed_timeout=60) as llm:
        assert llm.engine.routing_stats()["policy"] == policy
        _check_outputs(llm, reference["fresh"])
        stats = llm.engine.routing_stats()
        assert stats["moves"] == 0 and stats["prefix_routed"] == 0
        if policy == "round_robin":  # 2 x 11 requests, alternating
            assert stats["routed_requests"] == [11, 11]


def test_a_shared_prefix_group_lands_on_one_rank(balanced):
    engine = balanced.engine
    before = engine.routing_stats()
    tokens_before = [s["prompt_tokens"] for s in engine._rank_stats]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    # a prefix no earlier request had (GROUP's may be cached on both ranks by now, rightly spread)
    group = [list(range(300, 364)) + [200 + i, 3 + i, 4] for i in range(6)]
    for i, prompt in enumerate(group + FILLERS):
        engine.add_request(f"g{i}", None, params, prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.routing_stats()
    assert stats["prefix_routed"] - before["prefix_routed"] >= len(group) - 1  # (a filler may be too)
    # the ranks' own counters: one rank took in every prompt token of the group (more than the group
    # less one member plus every filler: a split group leaves no rank with that many)
    added = [s["prompt_tokens"] - t for s, t in zip(engine._rank_stats, tokens_before)]
    assert max(added) >= sum(map(len, group)) > sum(map(len, group[1:] + FILLERS)), added
