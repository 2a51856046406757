"""The KV tier end to end: shared prefixes that outgrow the device cache are kept in host memory and on
disk when the device cache evicts them, and loaded back on a later hit instead of recomputed. Outputs are
those of an engine without the tier (greedy and seeded sampling, sync, async and drafting loops), fewer
prompt tokens are computed, a second engine reuses the first one's disk files, and a corrupt file costs
a recompute of what it held, never another request's output."""

import numpy as np
import pytest
from deepinfer import SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=5, ignore_eos=True, seed=11)


def workload(vocab: int, rounds: int = 2, n_prefixes: int = 3, prefix_len: int = 22) -> list[list[int]]:
    """Rounds over a few long prefixes, each with its own short suffix: a later round finds its prefix
    evicted from a device cache that holds about one of them."""
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(4, vocab, prefix_len).tolist() for _ in range(n_prefixes)]
    return [p + rng.integers(4, vocab, 3).tolist() for _ in range(rounds) for p in prefixes]


def run(path, prompts, params=GREEDY, nextn=0, **kw):
    """Each prompt alone in turn (so the device cache has evicted the others' prefixes by its turn)."""
    kw = dict(max_model_len=40, block_size=BLOCK, num_kv_blocks=12, max_num_seqs=2) | kw
    engine = LLMEngine(EngineArgs(model=str(path), **kw), num_speculative_tokens=nextn)
    outs = []
    for j, prompt in enumerate(prompts):
        engine.add_request(str(j), None, params, prompt_token_ids=prompt)
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.append(o)
    engine.close()
    return outs, engine


def tokens(outs):
    return {o.request_id: (o.error, [list(c.token_ids) for c in o.outputs]) for o in outs}


def computed_prompt_tokens(engine) -> int:
    st = engine.scheduler_stats()
    return st["prefix_cache_query_tokens"] - st["prefix_cache_hit_tokens"] - st["tier_hit_tokens"]


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_host_tier_outputs_equal_no_tier_and_prefills_less(
    micro_checkpoint, share_loaded_models, use_async, params
):
    prompts = workload(512)
    base, plain = run(micro_checkpoint, prompts, params, async_scheduling=use_async)
    got, tiered = run(
        micro_checkpoint, prompts, params, async_scheduling=use_async, kv_host_tier_bytes=1 << 30
    )
    assert tokens(got) == tokens(base)
    assert all(o.error is None for o in got)
    st = tiered.kv_tier_stats()
    assert st["host_hits"] > 0 and st["stored"] > 0 and st["failed_loads"] == 0
    assert tiered.scheduler_stats()["tier_hit_tokens"] == st["host_hits"] * BLOCK
    assert computed_prompt_tokens(tiered) < computed_prompt_tokens(plain)
    assert plain.kv_tier_stats() is None


def test_host_then_disk_tier_and_a_second_engine_on_the_same_directory(
    micro_checkpoint, share_loaded_models, tmp_path
):
    prompts = workload(512, rounds=3)
    base, _ = run(micro_checkpoint, prompts)
    # a host tier of about 4 blocks: older entries move to disk, later hits come from both tiers
    first, engine = run(
        micro_checkpoint,
        prompts,
        kv_host_tier_bytes=1,
        kv_disk_tier_bytes=1 << 30,
        kv_disk_tier_dir=str(tmp_path),
    )
    del engine
    probe, engine = run(
        micro_checkpoint,
        prompts[:1],
        kv_host_tier_bytes=0,
        kv_disk_tier_bytes=1 << 30,
        kv_disk_tier_dir=str(tmp_path),
    )
    assert tokens(probe) == {"0": tokens(base)["0"]}
    st = engine.kv_tier_stats()
    assert st["disk_hits"] > 0 and st["host_hits"] == 0  # the first engine's files, verified and loaded
    assert tokens(first) == tokens(base)
    files = list(tmp_path.rglob("*.kv"))
    assert files and st["disk_bytes_used"] == sum(f.stat().st_size for f in files)


def test_host_tier_budget_pushes_to_disk(micro_checkpoint, share_loaded_models, tmp_path):
    prompts = workload(512, rounds=3)
    base, _ = run(micro_checkpoint, prompts)
    got, engine = run(
        micro_checkpoint,
        prompts,
        kv_host_tier_bytes=1,
        kv_disk_tier_bytes=1 << 30,
        kv_disk_tier_dir=str(tmp_path),
    )
    assert tokens(got) == tokens(base)
    st = engine.kv_tier_stats()
    assert st["demoted"] > 0 and st["disk_hits"] > 0 and st["host_bytes_used"] <= 1 << 20


def _corrupt_files(path) -> None:
    for f in path.rglob("*.kv"):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))


def test_corrupt_file_is_recomputed(micro_checkpoint, share_loaded_models, tmp_path):
    prompts = workload(512, rounds=1)
    base, _ = run(micro_checkpoint, prompts)
    disk = dict(kv_host_tier_bytes=0, kv_disk_tier_bytes=1 << 30, kv_disk_tier_dir=str(tmp_path))
    run(micro_checkpoint, prompts, **disk)
    _corrupt_files(tmp_path)
    # the first prompt hits the corrupt files and recomputes; the same prompt again finds no entry
    got, engine = run(micro_checkpoint, [prompts[0], prompts[0]], **disk)
    assert tokens(got) == {"0": tokens(base)["0"], "1": tokens(base)["0"]}
    st = engine.kv_tier_stats()
    assert st["failed_loads"] > 0 and st["disk_hits"] == 0
    assert engine.scheduler_stats()["num_preemptions"] > 0  # the loading sequence went back to waiting


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("stop_preempted", [False, True])
def test_a_failed_load_touches_only_the_requests_that_needed_it(
    micro_checkpoint, share_loaded_models, tmp_path, use_async, stop_preempted
):
    """A request whose prefix file is corrupt, scheduled in one step with a request that loads nothing:
    the first recomputes its prefix (or, where preempted requests stop, fails naming the load), the
    second gets the tokens it gets alone either way."""
    prompts = workload(512, rounds=1)
    fresh = np.random.default_rng(1).integers(4, 512, 9).tolist()
    base, _ = run(micro_checkpoint, [prompts[0], fresh])
    disk = dict(kv_host_tier_bytes=0, kv_disk_tier_bytes=1 << 30, kv_disk_tier_dir=str(tmp_path))
    run(micro_checkpoint, prompts, **disk)
    _corrupt_files(tmp_path)
    kw = dict(
        max_model_len=40, block_size=BLOCK, num_kv_blocks=12, max_num_seqs=2, async_scheduling=use_async
    )
    args = EngineArgs(model=str(micro_checkpoint), stop_preempted_request=stop_preempted, **kw, **disk)
    engine = LLMEngine(args, num_speculative_tokens=0)
    engine.add_request("corrupt", None, GREEDY, prompt_token_ids=prompts[0])
    engine.add_request("fresh", None, GREEDY, prompt_token_ids=fresh)
    got = {}
    while engine.has_unfinished_requests():
        got.update((o.request_id, o) for o in engine.step())
    assert engine.kv_tier_stats()["failed_loads"] > 0
    assert got["fresh"].error is None
    assert [list(c.token_ids) for c in got["fresh"].outputs] == tokens(base)["1"][1]
    if stop_preempted:
        assert "KV tier load failed" in got["corrupt"].error and "checksum mismatch" in got["corrupt"].error
    else:
        assert got["corrupt"].error is None
        assert [list(c.token_ids) for c in got["corrupt"].outputs] == tokens(base)["0"][1]
    # nothing is left held: the engine serves the prompt again (computed now: its keys left the tier)
    engine.add_request("again", None, GREEDY, prompt_token_ids=prompts[0])
    while engine.has_unfinished_requests():
        got.update((o.request_id, o) for o in engine.step())
    assert [list(c.token_ids) for c in got["again"].outputs] == tokens(base)["0"][1]
    engine.scheduler.check_invariants()
    engine.close()


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-tier"), seed=4)


@pytest.mark.parametrize("nextn", [0, 2])
def test_v41_pools_round_trip_through_the_tier(v41, nextn):
    """Every V4.1 pool (Engram ids, compressed and C1 entries, index keys, compressor inputs, drafter
    keys) through host memory, with and without DSpark drafting."""
    prompts = workload(256, rounds=2, n_prefixes=2)
    base, _ = run(v41, prompts, nextn=nextn)
    got, engine = run(v41, prompts, nextn=nextn, kv_host_tier_bytes=1 << 30)
    assert tokens(got) == tokens(base)
    assert engine.kv_tier_stats()["host_hits"] > 0


def test_settings_are_checked(micro_checkpoint, monkeypatch):
    with pytest.raises(ValueError, match="kv_host_tier_bytes must be an integer >= 0"):
        EngineArgs(model=str(micro_checkpoint), kv_host_tier_bytes=-1)
    with pytest.raises(ValueError, match="kv_disk_tier_dir must name a directory"):
        EngineArgs(model=str(micro_checkpoint), kv_disk_tier_bytes=10)
    monkeypatch.setenv("DEEPINFER_KV_HOST_TIER_BYTES", "123")
    assert EngineArgs(model=str(micro_checkpoint)).kv_host_tier_bytes == 123
    assert EngineArgs(model=str(micro_checkpoint), kv_host_tier_bytes=0).kv_host_tier_bytes == 0
    monkeypatch.setenv("DEEPINFER_KV_HOST_TIER_BYTES", "-5")
    with pytest.raises(ValueError, match="DEEPINFER_KV_HOST_TIER_BYTES"):
        EngineArgs(model=str(micro_checkpoint))
    with pytest.raises(ValueError, match="needs runner='paged'"):
        LLMEngine(EngineArgs(model=str(micro_checkpoint), runner="recompute", kv_host_tier_bytes=1 << 20))


def test_two_live_engines_share_one_directory(micro_checkpoint, share_loaded_models, tmp_path, monkeypatch):
    """The second engine starts before the first has written anything; it loads the first one's files
    once it has looked again (every schedule here), with the tokens it computes alone."""
    from deepinfer.engine import kv_tier

    monkeypatch.setattr(kv_tier, "RESCAN_S", 0.0)
    prompts = workload(512, rounds=1)
    base, _ = run(micro_checkpoint, prompts[:1])
    disk = dict(kv_host_tier_bytes=0, kv_disk_tier_bytes=1 << 30, kv_disk_tier_dir=str(tmp_path))
    kw = dict(max_model_len=40, block_size=BLOCK, num_kv_blocks=12, max_num_seqs=2)
    second = LLMEngine(EngineArgs(model=str(micro_checkpoint), **kw, **disk), num_speculative_tokens=0)
    run(micro_checkpoint, prompts, **disk)  # the first engine: evicts prompts[0]'s prefix to disk
    second.add_request("0", None, GREEDY, prompt_token_ids=prompts[0])
    got = []
    while second.has_unfinished_requests():
        got += second.step()
    assert tokens(got) == tokens(base)
    assert second.kv_tier_stats()["disk_hits"] > 0
    second.close()
