"""Attention data parallel + MoE expert parallel (engine/data_parallel.py) on 2 CPU processes (gloo).

Reference: the single-process engine on the same checkpoint. The paged runner's logits depend only on
the sequence (FP64-carrier numerics), so each request must come out of its DP rank with exactly the
single-process token ids, logprobs and top logprobs, although the ranks batch different requests,
finish at different steps (the finished rank joins the others' expert all-to-alls with idle forwards)
and hold only half of the routed experts each.
"""

import asyncio
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from deepinfer import LLM, AsyncLLM, SamplingParams
from deepinfer.bench.drafts import spec_keys, spec_snapshot
from deepinfer.bench.engine_driver import Driver
from deepinfer.bench.phases import DecodeConfig
from deepinfer.bench.rank_phases import run_decode_ranks
from deepinfer.cli import main as cli_main
from deepinfer.engine.data_parallel import DataParallelRank, assign_ranks
from deepinfer.engine_args import EngineArgs
from deepinfer_model import load_model
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_parallel import init_parallel
from deepinfer_parallel.launch import run_distributed
from outputs_common import assert_same

pytestmark = pytest.mark.distributed

# Different lengths and output budgets: the two ranks run different numbers of steps.
PROMPTS = [list(range(1, 30)), [3, 4], [7, 8, 9, 10, 11], [12, 40, 41] * 4, [500, 2, 77]]
MAX_TOKENS = [4, 11, 7, 2, 6]
GREEDY = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in MAX_TOKENS]
# Without seq_seed: the seeds come from the engine seed's stream in request order, also under DP.
SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m, logprobs=1) for m in MAX_TOKENS]


@pytest.fixture(scope="module")
def reference(micro_checkpoint):
    with LLM(str(micro_checkpoint), async_scheduling=False) as llm:
        greedy = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        sampled = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SAMPLED, use_tqdm=False)
    return {"greedy": greedy, "sampled": sampled}


@pytest.fixture(scope="module")
def dp_sync(micro_checkpoint):
    with LLM(
        str(micro_checkpoint), data_parallel_size=2, expert_parallel_size=2, async_scheduling=False,
        distributed_timeout=60,
    ) as llm:  # fmt: skip
        yield llm


@pytest.fixture(scope="module")
def dp_async(micro_checkpoint):
    with LLM(
        str(micro_checkpoint), data_parallel_size=2, expert_parallel_size=2, async_scheduling=True,
        distributed_timeout=60,
    ) as llm:  # fmt: skip
        yield llm


def test_parallel_sizes_are_validated_with_clear_errors(monkeypatch):
    EngineArgs(data_parallel_size=4, expert_parallel_size=2, device="cpu")  # EP groups of 2 DP ranks
    EngineArgs(data_parallel_size=2, expert_parallel_size=1, device="cpu")  # DP only, experts whole
    with pytest.raises(
        ValueError,
        match=r"expert_parallel_size must divide data_parallel_size \* context_parallel_size = 2 "
        r"\(one of \[1, 2\]",
    ):
        EngineArgs(data_parallel_size=2, expert_parallel_size=3, device="cpu")
    # the reference's derivation: expert_parallel_size alone sets data_parallel_size = ep // cp
    assert EngineArgs(expert_parallel_size=2, device="cpu").data_parallel_size == 2
    with pytest.raises(ValueError, match="expert_parallel_size must divide data_parallel_size \\* context"):
        EngineArgs(data_parallel_size=1, expert_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 0"):
        EngineArgs(data_parallel_size=-1, device="cpu")
    # context parallelism runs on spawned ranks too now; what it refuses is a runner other than paged
    assert EngineArgs(data_parallel_size=2, context_parallel_size=2, device="cpu").layout.describe() == (
        "world_size=4, dp=2, cp=2, ep=1"
    )
    with pytest.raises(ValueError, match="context_parallel_size > 1 needs runner = 'paged'"):
        EngineArgs(data_parallel_size=2, context_parallel_size=2, runner="recompute", device="cpu")
    with pytest.raises(ValueError, match="needs runner = 'paged'"):
        EngineArgs(data_parallel_size=2, expert_parallel_size=2, runner="recompute", device="cpu")
    with pytest.raises(ValueError, match="distributed_timeout must be an integer >= 1"):
        EngineArgs(distributed_timeout=0, device="cpu")
    monkeypatch.setenv("DEEPINFER_FP8_EXPERTS", "1")  # the FP8 experts have no expert-parallel path
    with pytest.raises(
        ValueError, match="DEEPINFER_FP8_EXPERTS=1 cannot be combined with expert parallelism"
    ):
        EngineArgs(data_parallel_size=2, expert_parallel_size=2, device="cpu")


def test_cli_shows_the_parallel_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--data-parallel-size", "--expert-parallel-size", "--distributed-timeout"):
        assert flag in out


def test_assign_ranks_balances_prompt_tokens_deterministically():
    costs = [29, 2, 5, 12, 3]
    ranks = assign_ranks(costs, 2)
    assert ranks == assign_ranks(costs, 2)
    load = [sum(c for c, r in zip(costs, ranks) if r == k) for k in range(2)]
    assert load == [29, 22]  # longest first: 29 | 12 + 5 + 3 + 2
    assert assign_ranks([4, 4, 4], 2) == [0, 1, 0]
    assert assign_ranks([7], 3) == [0]


def test_dp2_ep2_sync_loop_equals_single_process(dp_sync, reference):
    got = dp_sync.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert_same(got, reference["greedy"])
    assert all(s["generated_tokens"] > 0 for s in dp_sync.engine._rank_stats)  # both ranks served requests


def test_async_llm_over_dp2_streams_tokens_as_they_arrive(micro_checkpoint, reference):
    """The ranks report each streamed request's output after every step that gave it tokens: a stream
    grows over several outputs, never takes text back, and ends in exactly the single-process output."""

    async def collect(llm, ids, params):
        return [out async for out in llm.generate(prompt_token_ids=ids, sampling_params=params)]

    async def run():
        async with AsyncLLM(
            str(micro_checkpoint), data_parallel_size=2, expert_parallel_size=2, distributed_timeout=60
        ) as llm:
            streams = await asyncio.gather(*(collect(llm, ids, p) for ids, p in zip(PROMPTS, GREEDY)))
            assert llm.engine.partial_outputs == {}  # the finished outputs replaced them
            return streams

    streams = asyncio.run(run())
    for want, outs, max_tokens in zip(reference["greedy"], streams, MAX_TOKENS):
        assert_same([outs[-1]], [want])
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        if max_tokens > 2:
            assert len(outs) > 1, want.request_id  # not all at the end
        deltas = []
        for before, after in zip([None, *outs], outs):
            seen = before.outputs[0] if before is not None else None
            now = after.outputs[0]
            if seen is not None:
                assert now.token_ids[: len(seen.token_ids)] == seen.token_ids
                assert now.text.startswith(seen.text)
            deltas.append(now.text[len(seen.text) if seen is not None else 0 :])
        assert "".join(deltas) == want.outputs[0].text


def test_uneven_request_counts_leave_a_rank_idle(dp_sync, reference):
    # 3 requests on 2 ranks, then 1 request: rank 1 only joins the all-to-alls with idle forwards.
    picks = [1, 3, 4]
    got = dp_sync.generate(
        prompt_token_ids=[PROMPTS[i] for i in picks],
        sampling_params=[GREEDY[i] for i in picks],
        use_tqdm=False,
    )
    assert_same(got, [reference["greedy"][i] for i in picks])
    before = dp_sync.engine._rank_stats[1]["generated_tokens"]
    got = dp_sync.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY[0], use_tqdm=False)
    assert_same(got, reference["greedy"][:1])
    assert dp_sync.engine._rank_stats[1]["generated_tokens"] == before


def test_bad_requests_fail_alone(dp_sync, reference):
    # Rejected in the front (invalid sampling parameters) ...
    params = list(GREEDY)
    params[2] = {"temperature": -1.0}
    got = dp_sync.generate(
        prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False, raise_on_error=False
    )
    assert "temperature" in got[2].error and not got[2].outputs
    assert_same(got[:2] + got[3:], reference["greedy"][:2] + reference["greedy"][3:])
    # ... and by the engine API, which runs the checks of one engine's add_request before queueing
    engine = dp_sync.engine
    for i in range(len(PROMPTS)):
        engine.add_request(f"ok{i}", None, GREEDY[i], prompt_token_ids=PROMPTS[i])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]=100000: must be in \[0, 512\)"):
        engine.add_request("bad", None, GREEDY[0], prompt_token_ids=[1, 100_000])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok1", None, GREEDY[0], prompt_token_ids=PROMPTS[0])
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert sorted(outs) == [f"ok{i}" for i in range(len(PROMPTS))]
    assert_same([outs[f"ok{i}"] for i in range(len(PROMPTS))], reference["greedy"])


def test_dp2_ep2_async_loop_equals_single_process_greedy_and_sampled(dp_async, reference):
    # dp_async's first use, in the reference's order: the greedy requests draw seeds too (no seq_seed),
    # so the sampled ones get the same seeds from the engine seed's stream as in the reference
    got = dp_async.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert_same(got, reference["greedy"])
    got = dp_async.generate(prompt_token_ids=PROMPTS, sampling_params=SAMPLED, use_tqdm=False)
    assert_same(got, reference["sampled"])


def test_abort_all_returns_every_request_and_the_world_goes_on(dp_async, reference):
    engine = dp_async.engine
    # 4 x 4 samples of 480 tokens: ~9 s on a loaded 2-core host, the abort comes after ~2 s
    long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True, n=4)
    for i in range(4):
        engine.add_request(f"long{i}", None, long, prompt_token_ids=PROMPTS[i])
    engine.step()  # sends them; waits up to a second for outputs
    done = {o.request_id: o for o in engine.step() + engine.abort_all()}
    assert sorted(done) == [f"long{i}" for i in range(4)]
    reasons = [c.finish_reason for o in done.values() for c in o.outputs]
    assert "abort" in reasons and set(reasons) <= {"abort", "length"}
    assert not engine.has_unfinished_requests()
    got = dp_async.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert_same(got, reference["greedy"])


def test_dp2_without_ep_and_a_crashed_rank_raises_in_the_front(micro_checkpoint, reference):
    llm = LLM(str(micro_checkpoint), data_parallel_size=2, expert_parallel_size=1, distributed_timeout=60)
    try:
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        assert_same(got, reference["greedy"])
        victim = llm.engine._procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"data-parallel rank 1 exited with code -9"):
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 10  # found by the liveness check, not by a timeout
        assert not any(p.is_alive() for p in llm.engine._procs)  # the others are stopped too
        with pytest.raises(RuntimeError, match="cannot be used"):
            llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY[0], use_tqdm=False)
    finally:
        llm.close()


def test_structured_sampled_and_bad_grammar_requests_under_async_dp(real_vocab_checkpoint):
    # Structured rows take the async loop's reconcile path; the bad grammar is refused in the front
    # before it draws seeds, so the sampled requests after it get the single-process seeds.
    regex = {"schema_type": "regex", "schema": "[a-z ]{3,12}"}
    bad = {"schema_type": "regex", "schema": "(?=lookahead)x"}
    so = [regex, None, bad, None, regex]
    params = [
        SamplingParams(temperature=0.7, max_tokens=8, so_args=so[i], n=2 if i == 1 else 1, logprobs=1)
        for i in range(len(PROMPTS))
    ]
    with LLM(str(real_vocab_checkpoint)) as llm:
        want = llm.generate(
            prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False, raise_on_error=False
        )
    with LLM(
        str(real_vocab_checkpoint), data_parallel_size=2, expert_parallel_size=2, distributed_timeout=60
    ) as llm:
        got = llm.generate(
            prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False, raise_on_error=False
        )
    assert "lookahead" in got[2].error and "lookahead" in want[2].error
    assert_same(got[:2] + got[3:], want[:2] + want[3:])
    for i in (0, 4):
        assert re.fullmatch("[a-z ]{3,12}", got[i].outputs[0].text), got[i].outputs[0].text


def test_a_rank_that_fails_to_start_reports_its_traceback(micro_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(micro_checkpoint, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a truncated download
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)data-parallel rank \d failed while starting:.*Traceback"):
        LLM(str(broken), data_parallel_size=2, expert_parallel_size=2, distributed_timeout=60)
    assert time.monotonic() - t0 < 30


def test_v41_with_dspark_drafts_under_dp2_ep2(tmp_path, monkeypatch):
    # The §11 tiny V4.1 has draft blocks: drafting runs through the draft experts sharded over the EP
    # ranks (DEEPINFER_EP_SHARD_DRAFT_EXPERTS, on by default), verification through the sharded backbone;
    # tokens equal the single-process engine's.
    path = str(make_v41_checkpoint(tmp_path / "v41", seed=0))
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")  # the rank processes inherit it
    prompts = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42]]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=1)
    with LLM(path, max_model_len=48) as llm:
        want = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        want_counts = llm.engine.spec_counts()
    with LLM(
        path, max_model_len=48, data_parallel_size=2, expert_parallel_size=2, distributed_timeout=60
    ) as llm:
        assert llm.engine.num_speculative_tokens == 2
        before = spec_snapshot(llm.engine)
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        got_counts = llm.engine.spec_counts()
        keys = spec_keys(before, spec_snapshot(llm.engine))
        # the bench's decode rows from the ranks carry the per-position acceptance too
        (row,) = run_decode_ranks(
            Driver(llm.engine, 0), DecodeConfig(batches=[2], context=4, warmup_steps=1, measure_steps=2, nextn=2),
            token_budget=4096,
        )  # fmt: skip
    assert_same(got, want)
    assert all(o.metrics.num_draft_tokens > 0 for o in got)
    # the ranks' draft counts reach the front summed: per request, drafting and verification do not
    # depend on the batch, so they equal the single engine's
    assert want_counts["verified"][0] > 0
    for key in ("verified", "accepted", "request_steps"):
        assert got_counts[key] == want_counts[key], key
    assert [keys[f"verified_drafts_pos{j}"] for j in (1, 2)] == want_counts["verified"]
    assert row["verified_drafts_pos1"] > 0 and row["accept_rate_pos1"] is not None
    assert row["mean_accepted_len_tokens"] is not None


@pytest.mark.parametrize("shard", ["1", "0"], ids=["sharded-draft-experts", "whole-draft-experts"])
def test_v41_uneven_draft_work_under_dp2_ep2(tmp_path, monkeypatch, shard):
    """The ranks draft unevenly: one holds a long request alone, the other two short ones whose draft
    lengths differ near their ends (two draft forwards in a step) and that finish early (the rank then
    drafts nothing while the other still does). With the draft experts sharded, every draft forward is a
    collective: the idle rank joins it (`DataParallelRank.agree_drafts`); tokens stay one engine's."""
    path = str(make_v41_checkpoint(tmp_path / "v41", seed=0))
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")  # the rank processes inherit both
    monkeypatch.setenv("DEEPINFER_EP_SHARD_DRAFT_EXPERTS", shard)
    prompts = [[0, 17, 99, 4, 250, 61, 8, 130, 77, 12, 9, 31], [5, 6, 7, 8], [100, 3, 42]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=1) for m in (16, 4, 6)]
    assert assign_ranks([len(p) for p in prompts], 2) == [0, 1, 1]
    with LLM(path, max_model_len=48) as llm:
        want = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    with LLM(
        path, max_model_len=48, data_parallel_size=2, expert_parallel_size=2, distributed_timeout=60
    ) as llm:
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        who = [t["identity"] for t in llm.engine.step_traces()]
    assert_same(got, want)
    assert all(o.metrics.num_draft_tokens > 0 for o in got)
    assert [w["draft_experts_sharded"] for w in who] == [shard == "1"] * 2


def _unfinished_forward_worker(rank, world, ckpt, ref_path):
    ref = torch.load(ref_path)
    dp = DataParallelRank(init_parallel(dp=2, ep=2), torch.device("cpu"))
    model = dp.load_model(Path(ckpt), torch.float32, torch.device("cpu"))
    coll = dp.collectives
    if rank == 0:  # a forward that stops after the first MoE layer (as a failing one would) ...
        coll.begin()
        y = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        coll(0, model.layers[0], y, torch.tensor([5, 6, 7]))
        coll.finish()  # ... joins the other layers' all-to-alls without tokens
    else:
        coll.idle()
    # the EP group is still in step: a full forward on each rank equals the single-process one
    logits = model.forward(ref["prompts"][rank])
    assert torch.equal(logits, ref["logits"][rank]), (
        f"rank {rank}: logits differ after the unfinished forward"
    )


def test_an_unfinished_forward_joins_the_remaining_all_to_alls(micro_checkpoint, tmp_path):
    model = load_model(micro_checkpoint)
    prompts = [torch.tensor(PROMPTS[0]), torch.tensor(PROMPTS[3])]
    torch.save({"prompts": prompts, "logits": [model.forward(p) for p in prompts]}, tmp_path / "ref.pt")
    run_distributed(
        _unfinished_forward_worker, 2, str(micro_checkpoint), str(tmp_path / "ref.pt"), timeout_s=60
    )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.usefixtures("deep_ep")
def test_dp2_ep2_deepep_on_cuda_close_to_single_process(micro_checkpoint, monkeypatch, first_token_close):
    # DeepEP sends BF16 rows and combines in BF16: the first token's log-probabilities (same context in
    # both runs) agree to a BF16-sized tolerance rather than bitwise; greedy tokens may flip after that.
    params = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5) for _ in PROMPTS]
    with LLM(str(micro_checkpoint), device="cuda", async_scheduling=False) as llm:
        want = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    monkeypatch.setenv("DEEPINFER_EP_BACKEND", "deepep")
    with LLM(
        str(micro_checkpoint),
        device="cuda",
        data_parallel_size=2,
        expert_parallel_size=2,
        async_scheduling=False,
    ) as llm:
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    first_token_close(got, want)
