"""The data-parallel router (engine/dp_balance.py) as pure code: given the loads it is told, every choice
is determined, so each test states the loads and the ranks that must follow from them."""

import random

import pytest
import xxhash
from deepinfer.engine.dp_balance import (
    BalanceConfig,
    Move,
    PrefixIndex,
    RankLoad,
    Router,
    assign_ranks,
    prefix_block_hashes,
    request_cost,
)
from deepinfer.engine_args import EngineArgs

BS = 4  # block size of these tests


def _prompt(prefix: list[int], tail: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return prefix + [rng.randrange(1000, 2000) for _ in range(tail)]


def test_request_cost_counts_prompt_and_capped_budget_per_sample():
    assert request_cost(10, 5, 1, 100) == 15
    assert request_cost(10, 5, 3, 100) == 45
    assert request_cost(98, 5, 1, 100) == 100  # the engine caps the budget at max_model_len - prompt
    assert request_cost(100, 5, 2, 100) == 200


def test_prefix_hashes_are_chained_over_full_blocks():
    ids = list(range(1, 15))  # 3 full blocks of 4, 2 tokens left over
    hashes = prefix_block_hashes(ids, BS)
    assert len(hashes) == 3
    # an independent spelling of the chain: each block's hash covers the previous one
    prev, want = 0, []
    for b in range(3):
        data = prev.to_bytes(8, "little") + b"".join(
            t.to_bytes(8, "little", signed=True) for t in ids[4 * b : 4 * b + 4]
        )
        prev = xxhash.xxh3_64_intdigest(data)
        want.append(prev)
    assert hashes == want
    changed_late = ids[:9] + [999] + ids[10:]  # block 2 differs: blocks 0 and 1 keep their hashes
    assert prefix_block_hashes(changed_late, BS)[:2] == hashes[:2]
    assert prefix_block_hashes(changed_late, BS)[2] != hashes[2]
    changed_early = [999] + ids[1:]  # block 0 differs: every later hash differs (whole-prefix keys)
    assert all(a != b for a, b in zip(prefix_block_hashes(changed_early, BS), hashes))
    assert prefix_block_hashes(ids[:3], BS) == []


def test_prefix_index_is_a_bounded_lru_and_counts_leading_blocks():
    index = PrefixIndex(world=2, capacity_blocks=3)
    index.record(0, [1, 2, 3])
    assert index.overlap(0, [1, 2, 3, 4]) == 3
    assert index.overlap(0, [2, 3]) == 2
    assert index.overlap(0, [9, 1, 2]) == 0  # leading blocks only
    assert index.overlap(1, [1]) == 0  # per rank
    index.overlap(0, [1])  # a lookup is no use: only routing refreshes
    index.record(0, [1])  # 1 is now the newest; 2 the oldest
    index.record(0, [7])
    assert index.size(0) == 3
    assert index.overlap(0, [2]) == 0 and index.overlap(0, [1]) == 1 and index.overlap(0, [3]) == 1
    with pytest.raises(ValueError, match="capacity_blocks must be an integer >= 1"):
        PrefixIndex(2, 0)


def test_policy_and_config_are_validated():
    with pytest.raises(
        ValueError, match=r"dp_routing must be one of balanced, static, round_robin, got 'fastest'"
    ):
        Router(2, "fastest", BS)
    with pytest.raises(ValueError, match="overload_factor must be >= 1.0"):
        BalanceConfig(overload_factor=0.5)
    with pytest.raises(ValueError, match="slack_tokens must be an integer >= 0"):
        BalanceConfig(slack_tokens=-1)
    with pytest.raises(ValueError, match=r"kv_high must be in \(0, 1\]"):
        BalanceConfig(kv_high=0.0)


def test_static_is_the_longest_first_split_and_round_robin_cycles_across_batches():
    reqs = [([1] * c, c) for c in (29, 2, 5, 12, 3)]
    static = Router(2, "static", BS)
    assert static.route_batch(reqs) == assign_ranks([29, 2, 5, 12, 3], 2) == [0, 1, 1, 1, 1]
    rr = Router(3, "round_robin", BS)
    assert rr.route_batch(reqs) == [0, 1, 2, 0, 1]
    assert rr.route_batch(reqs[:2]) == [2, 0]
    for r in (static, rr):
        assert r.plan_move() is None  # only the balanced policy moves requests


def test_balanced_routes_to_the_least_queued_tokens_longest_first():
    router = Router(2, "balanced", BS)
    # distinct prompts (no shared prefix): longest first, each where it ends the soonest
    reqs = [(_prompt([], n, seed=i), n) for i, n in enumerate([10, 300, 40, 250, 20])]
    assert router.route_batch(reqs) == [0, 0, 1, 1, 1]  # 300 -> 0, 250 -> 1, 40 -> 1, 20 -> 1, 10 -> 0
    assert [router.estimated(r) for r in (0, 1)] == [310, 310]
    # what a rank reports replaces what the front had sent it once the report covers that message
    router.sent(0, 1)
    router.sent(1, 1)
    router.report(0, RankLoad(queued_tokens=5, messages=0))  # measured before taking the batch in
    assert router.estimated(0) == 315
    router.report(0, RankLoad(queued_tokens=7, messages=1))
    assert router.estimated(0) == 7
    assert router.route(_prompt([], 8, seed=9), 8) == 0


SHARED = list(range(100, 116))  # 4 full blocks


def _group_router(slack_tokens: int) -> Router:
    """Rank 0 holds an unrelated request, rank 1 the first three members of a shared-prefix group."""
    router = Router(2, "balanced", BS, BalanceConfig(overload_factor=1.25, slack_tokens=slack_tokens))
    assert router.route(_prompt([], 20, seed=1), 20) == 0
    # the group's first request goes to the emptier rank; its prefix is recorded there
    assert router.route(_prompt(SHARED, 2, seed=2), 18) == 1
    # later members add only what the cached prefix does not cover (18 - 16 = 2 tokens each) to the
    # choice, though the load counts them whole until the rank reports them started: the third one
    # makes rank 1 36 + 2 = 38 > 1.25 x (20 + 38) / 2 = 36.25, within a slack of 5
    for i in range(2):
        assert router.route(_prompt(SHARED, 2, seed=3 + i), 18) == 1
    assert [router.estimated(r) for r in (0, 1)] == [20, 3 * 18]
    assert router.stats.prefix_routed == 2 and router.stats.prefix_blocks == 8
    return router


def test_a_shared_prefix_group_stays_on_one_rank_until_it_would_overload_it():
    for slack, want in ((5, 0), (100, 1)):
        router = _group_router(slack)
        # rank 1 then reports 60 queued tokens: a member (2 tokens there, 18 elsewhere) would make it
        # 62 > 1.25 x (20 + 62) / 2 = 51.25 (+ slack): with a slack of 5 it goes to rank 0 (20 + 18 = 38),
        # with a slack of 100 tokens it stays with its prefix
        router.sent(0, 1)
        router.sent(1, 1)
        router.report(0, RankLoad(queued_tokens=20, messages=1))
        router.report(1, RankLoad(queued_tokens=60, messages=1))
        assert router.route(_prompt(SHARED, 2, seed=9), 18) == want
    assert router.prefix.overlap(0, prefix_block_hashes(SHARED, BS)) == 0  # kept on rank 1 only
    router = _group_router(5)
    router.sent(1, 1)
    router.report(1, RankLoad(queued_tokens=60, messages=1))
    assert router.route(_prompt(SHARED, 2, seed=9), 18) == 0
    assert router.prefix.overlap(0, prefix_block_hashes(SHARED, BS)) == 4  # recorded where it went


def test_a_rank_with_full_kv_gets_no_prefix_affinity_and_is_the_last_choice():
    router = Router(2, "balanced", BS, BalanceConfig(slack_tokens=1000, kv_high=0.9))
    shared = list(range(100, 112))
    assert router.route(_prompt(shared, 3, seed=1), 15) == 0
    router.report(0, RankLoad(queued_tokens=0, kv_usage=0.95, messages=5))
    router.report(1, RankLoad(queued_tokens=500, kv_usage=0.2, messages=5))
    assert router.route(_prompt(shared, 3, seed=2), 15) == 1  # less loaded, but its KV is full
    router.report(1, RankLoad(queued_tokens=500, kv_usage=0.95, messages=5))
    assert router.route(_prompt([], 7, seed=3), 7) == 0  # both full: the emptier one


def test_the_same_calls_give_the_same_ranks():
    rng = random.Random(0)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    batch = []
    for i in range(40):
        p = prefixes[i % 3] if i % 2 else []
        batch.append((_prompt(p, rng.randrange(1, 30), seed=i), rng.randrange(5, 80)))
    runs = []
    for _ in range(2):
        router = Router(3, "balanced", BS)
        ranks = router.route_batch(batch[:20])
        router.report(1, RankLoad(queued_tokens=3, kv_usage=0.5, messages=1))
        ranks += router.route_batch(batch[20:])
        runs.append(ranks)
    assert runs[0] == runs[1]
    assert set(runs[0]) == {0, 1, 2}


def test_an_overloaded_rank_is_asked_for_half_the_gap_once_at_a_time():
    router = Router(2, "balanced", BS, BalanceConfig(overload_factor=1.25, slack_tokens=100))
    router.report(0, RankLoad(queued_tokens=1000, movable_tokens=0, messages=3))
    router.report(1, RankLoad(queued_tokens=0, messages=3))
    assert router.plan_move() is None  # nothing that has not started
    router.report(0, RankLoad(queued_tokens=1000, movable_tokens=600, messages=3))
    move = router.plan_move()
    assert move == Move(src=0, dst=1, budget_tokens=500)
    assert router.plan_move() is None  # rank 0 has not answered yet
    # rank 0 answers the move (its message 4) with 300 tokens of requests, which go to rank 1
    router.moved(move, 4, [200, 100])
    router.assign(1, _prompt([], 10, seed=1), 200)
    router.assign(1, _prompt([], 10, seed=2), 100)
    router.sent(1, 4)
    assert [router.estimated(r) for r in (0, 1)] == [700, 300]
    router.report(0, RankLoad(queued_tokens=690, movable_tokens=0, messages=4))  # covers the move
    router.report(1, RankLoad(queued_tokens=295, messages=4))
    assert [router.estimated(r) for r in (0, 1)] == [690, 295]
    assert router.stats.moves == 1 and router.stats.moved_requests == 2 and router.stats.moved_tokens == 300
    # within 1.25 x mean + slack (690 <= 1.25 * 492.5 + 100): no move
    router.report(0, RankLoad(queued_tokens=690, movable_tokens=300, messages=4))
    assert router.plan_move() is None


def test_an_unanswered_move_with_nothing_handed_back_frees_the_rank_for_another():
    router = Router(3, "balanced", BS, BalanceConfig(slack_tokens=0))
    router.report(2, RankLoad(queued_tokens=900, movable_tokens=900, messages=1))
    router.report(0, RankLoad(queued_tokens=100, messages=1))
    move = router.plan_move()
    assert move == Move(src=2, dst=1, budget_tokens=450)  # rank 1 is the emptiest
    router.moved(move, 2, [])  # everything had started meanwhile
    assert router.estimated(2) == 900 and router.stats.moved_requests == 0
    assert router.plan_move() == move


def test_engine_args_take_the_policy_from_the_field_or_the_environment(monkeypatch):
    monkeypatch.delenv("DEEPINFER_DP_ROUTING", raising=False)
    assert EngineArgs(device="cpu").dp_routing == "balanced"
    monkeypatch.setenv("DEEPINFER_DP_ROUTING", "round_robin")
    assert EngineArgs(device="cpu").dp_routing == "round_robin"
    assert EngineArgs(device="cpu", dp_routing="static").dp_routing == "static"
    with pytest.raises(
        ValueError, match=r"dp_routing must be one of balanced, static, round_robin, got 'lpt'"
    ):
        EngineArgs(device="cpu", dp_routing="lpt")
    monkeypatch.setenv("DEEPINFER_DP_ROUTING", "fair")
    with pytest.raises(
        ValueError, match=r"DEEPINFER_DP_ROUTING must be one of balanced, static, round_robin, got 'fair'"
    ):
        EngineArgs(device="cpu")
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    monkeypatch.delenv("DEEPINFER_DP_ROUTING")
    assert EngineArgs.from_cli_args(parser.parse_args(["--dp-routing", "static"])).dp_routing == "static"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_engine_hands_back_only_requests_it_has_not_started(micro_checkpoint, async_scheduling):
    from deepinfer import LLM, SamplingParams

    prompts = [[5 + i, 6, 7, 8, 9] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(micro_checkpoint), max_num_seqs=1, async_scheduling=async_scheduling) as llm:
        engine = llm.engine
        want = {o.prompt_token_ids[0]: o.outputs[0].token_ids for o in llm.generate(
            prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
        )}  # fmt: skip
        prompt_tokens = engine.stats.prompt_tokens
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
        assert engine.table.tokens_left() == (4 * 9, 4 * 9)
        engine.step()  # r0 is scheduled (and with the async loop, already the step after)
        queued, movable = engine.table.tokens_left()
        assert movable == 3 * 9 and queued < 4 * 9
        assert engine.withdraw_request("r0") is None  # started
        assert engine.withdraw_request("nope") is None
        state = engine.withdraw_request("r2")
        assert state is not None and state.prompt_token_ids == prompts[2] and "r2" not in engine.requests
        assert engine.table.tokens_left()[1] == 2 * 9
        assert engine.stats.prompt_tokens == prompt_tokens + 3 * 5
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step())
        assert sorted(outs) == ["r0", "r1", "r3"]  # nothing comes out for the request handed back
        # served from the start elsewhere (here: the same engine, later), with its seeds, it is unchanged
        engine.add_request(
            "r2", None, state.params, state.prompt_token_ids, seeds=[s.seed for s in state.seqs]
        )
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step())
        for rid, out in outs.items():
            assert out.outputs[0].token_ids == want[out.prompt_token_ids[0]], rid
        assert engine.scheduler_stats()["num_running"] == engine.scheduler_stats()["num_waiting"] == 0
