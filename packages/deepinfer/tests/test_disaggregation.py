"""Prefill / decode disaggregation: PROMPT engines prefill and hand requests off (engine/pd_roles.py,
engine/handoff.py), COMPLETION engines decode them, a front runs one of each in its own process
(engine/disaggregated.py).

Reference: a NORMAL engine on the same checkpoint. The paged runner's logits depend only on the
sequence, and the decode engine re-feeds the last prompt token over the imported blocks, so every
request must come out with exactly the NORMAL engine's tokens and logprobs.
"""

import os
import signal
import time

import pytest
from deepinfer import LLM, SamplingParams
from deepinfer.engine.handoff import HandoffError, HandoffRecord
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.pd_roles import DecodeFull
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_model.testing import make_checkpoint
from deepinfer_model.testing.checkpoint import tiny_config
from outputs_common import assert_same_by_id as assert_same

BLOCK = 4
# lengths 1, an exact multiple of the block size (8), one over (9), several blocks (13)
PROMPTS = [[5], list(range(1, 9)), list(range(40, 49)), list(range(3, 16))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True, logprobs=2, n=2)
SEEDED = SamplingParams(temperature=1.0, top_k=50, max_tokens=5, ignore_eos=True, logprobs=1, seed=7)


def kw(**more):
    return (
        dict(block_size=BLOCK, max_model_len=48, num_kv_blocks=64, max_num_seqs=4, async_scheduling=False)
        | more
    )


def normal_outputs(path, prompts, params, **more):
    engine = LLMEngine(EngineArgs(model=str(path), **kw(**more)), num_speculative_tokens=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, params, prompt_token_ids=p)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    engine.close()
    return outs


def split_outputs(path, prompts, params, decode_kw=None, **more):
    """Prefill on a PROMPT engine, hand off through the flat format, decode on a COMPLETION engine;
    hand-offs that do not fit wait. Returns the outputs, the peak of held hand-offs and both engines."""
    pe = LLMEngine(EngineArgs(model=str(path), engine_type="prompt", **kw(**more)))
    ce = LLMEngine(
        EngineArgs(
            model=str(path),
            engine_type="completion",
            stop_preempted_request=True,
            **kw(**(decode_kw or more)),
        )
    )
    for i, p in enumerate(prompts):
        pe.add_request(str(i), None, params, prompt_token_ids=p)
    held, outs, peak = [], {}, 0
    while pe.has_unfinished_requests() or held or ce.has_unfinished_requests():
        if pe.has_unfinished_requests():
            for o in pe.step():
                assert o.error is None and [c.finish_reason for c in o.outputs] == ["prefilled"], o
                assert all(c.token_ids == [] for c in o.outputs)
            held += [HandoffRecord.from_bytes(r.to_bytes()) for r in pe.take_handoffs()]
        while held:
            try:
                ce.add_handoff(held[0])
            except DecodeFull:
                break
            held.pop(0)
        peak = max(peak, len(held))
        if ce.has_unfinished_requests():
            outs.update({o.request_id: o for o in ce.step()})
    return outs, peak, pe, ce


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, SEEDED], ids=["greedy", "sampled-n2", "seeded"])
def test_prompt_then_completion_engine_equals_normal(
    micro_checkpoint, share_loaded_models, engine_clean, params
):
    want = normal_outputs(micro_checkpoint, PROMPTS, params)
    got, _, pe, ce = split_outputs(micro_checkpoint, PROMPTS, params)
    assert_same(got, want)
    engine_clean(pe)  # every prefilled sequence released with its blocks
    engine_clean(ce)
    assert ce.stats.prompt_tokens == sum(len(p) for p in PROMPTS) * params.n


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-disagg"), seed=4)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_v41_pools_survive_the_hand_off(v41, share_loaded_models, params):
    """Every V4.1 pool (Engram ids, compressed and C1 entries, index keys, compressor inputs of
    incomplete blocks, drafter keys) moves with the request."""
    prompts = [[7], list(range(10, 26)), list(range(30, 49))]
    want = normal_outputs(v41, prompts, params, max_model_len=64)
    got, _, _, _ = split_outputs(v41, prompts, params, max_model_len=64)
    assert_same(got, want)


def test_completion_engine_with_few_blocks_holds_hand_offs_and_finishes_all(
    micro_checkpoint, share_loaded_models, engine_clean
):
    # 6 blocks of 4 (max_model_len 24): one request at its longest (13 + 6 tokens = 5 blocks) at a time
    want = normal_outputs(micro_checkpoint, PROMPTS, GREEDY)
    got, peak, _, ce = split_outputs(
        micro_checkpoint, PROMPTS, GREEDY, decode_kw=dict(num_kv_blocks=6, max_model_len=24)
    )
    assert_same(got, want)
    assert peak >= 2
    engine_clean(ce)
    assert ce.scheduler_stats()["num_preemptions"] == 0


def test_hand_off_from_another_block_size_or_checkpoint_is_refused(
    micro_checkpoint, tmp_path, share_loaded_models
):
    pe = LLMEngine(EngineArgs(model=str(micro_checkpoint), engine_type="prompt", **kw()))
    pe.add_request("r", None, GREEDY, prompt_token_ids=list(range(1, 10)))
    while pe.has_unfinished_requests():
        pe.step()
    (record,) = pe.take_handoffs()
    other_block = LLMEngine(
        EngineArgs(
            model=str(micro_checkpoint),
            engine_type="completion",
            stop_preempted_request=True,
            **kw(block_size=8),
        )
    )
    with pytest.raises(HandoffError, match="block_size 4 != this engine's 8"):
        other_block.add_handoff(record)
    config = tiny_config(
        vocab_size=512,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        n_routed_experts=4,
    )
    other = make_checkpoint(tmp_path / "other", config, seed=9)  # the micro model's shape, other weights
    other_model = LLMEngine(
        EngineArgs(model=str(other), engine_type="completion", stop_preempted_request=True, **kw())
    )
    with pytest.raises(HandoffError, match=r"other cache facts \(differing: weights\)"):
        other_model.add_handoff(record)
    assert not other_model.requests and other_model.scheduler_stats()["num_free_blocks"] == 64
    data = bytearray(record.to_bytes())
    data[-1] ^= 0xFF
    with pytest.raises(ValueError, match="checksum mismatch"):
        HandoffRecord.from_bytes(bytes(data))


def test_engine_type_arguments_are_checked(micro_checkpoint, share_loaded_models):
    with pytest.raises(ValueError, match="engine_type must be one of normal, prompt, completion"):
        EngineArgs(engine_type="decode")
    with pytest.raises(ValueError, match="needs stop_preempted_request=True"):
        EngineArgs(engine_type="completion")
    with pytest.raises(ValueError, match="disaggregation must be one of off, shm, tcp"):
        EngineArgs(disaggregation="nccl")
    with pytest.raises(ValueError, match="engine_type must be 'normal' there"):
        EngineArgs(disaggregation="shm", engine_type="prompt")
    with pytest.raises(ValueError, match="disaggregation_max_held must be an integer >= 1"):
        EngineArgs(disaggregation="shm", disaggregation_max_held=0)
    with pytest.raises(ValueError, match="needs runner='paged'"):
        EngineArgs(disaggregation="tcp", runner="recompute")
    ce = LLMEngine(
        EngineArgs(model=str(micro_checkpoint), engine_type="completion", stop_preempted_request=True, **kw())
    )
    with pytest.raises(ValueError, match="takes requests as hand-offs"):
        ce.add_request("x", None, GREEDY, prompt_token_ids=[1, 2])
    with pytest.raises(ValueError, match="take_handoffs needs engine_type='prompt'"):
        ce.take_handoffs()
    with pytest.raises(ValueError, match="num_speculative_tokens must be 0 on a prompt engine"):
        LLMEngine(
            EngineArgs(model=str(micro_checkpoint), engine_type="prompt", **kw()), num_speculative_tokens=2
        )
    pe = LLMEngine(EngineArgs(model=str(micro_checkpoint), engine_type="prompt", **kw()))
    with pytest.raises(ValueError, match="prompt_logprobs are not computed by prompt engines"):
        pe.add_request("p", None, SamplingParams(prompt_logprobs=1), prompt_token_ids=[1, 2])
    assert not pe.requests and not pe.role.requests


# ---------------------------------------------------------------------------- the front, with processes
FRONT = dict(
    block_size=BLOCK, max_model_len=32, num_kv_blocks=8, max_num_seqs=4, distributed_startup_timeout=300
)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_front_outputs_equal_normal_with_a_full_decode_engine(micro_checkpoint, transport):
    """8 blocks: the decode engine holds at most one request at its longest, the front holds the rest."""
    prompts = PROMPTS * 2
    params = [GREEDY, SEEDED, SAMPLED.clone(), GREEDY] * 2
    with LLM(str(micro_checkpoint), async_scheduling=False, **FRONT) as llm:
        want = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    with LLM(str(micro_checkpoint), disaggregation=transport, disaggregation_max_held=3, **FRONT) as llm:
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert llm.engine.held_peak >= 1
        assert llm.engine.sent_back == 0  # the front counts the hand-offs on their way as reserved
        assert llm.engine.restarts == {"prompt": 0, "completion": 0}
    assert_same({str(i): o for i, o in enumerate(got)}, {str(i): o for i, o in enumerate(want)})


@pytest.mark.slow
def test_front_survives_a_decode_engine_that_dies(micro_checkpoint):
    """Killed mid-request, the decode engine fails only the requests it held (named in their error);
    the front starts it again and later requests come out as a NORMAL engine's."""
    # long enough that the kill lands mid-request however fast the decode engine runs ahead of the front
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with LLM(str(micro_checkpoint), async_scheduling=False, **FRONT) as llm:
        want = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    with LLM(
        str(micro_checkpoint), disaggregation="shm", **(FRONT | {"num_kv_blocks": 128, "max_model_len": 512})
    ) as llm:
        engine = llm.engine
        engine.add_request("victim", None, long, prompt_token_ids=list(range(1, 10)))
        deadline = time.monotonic() + 120
        while engine.num_generated("victim") < 2:
            assert not engine.step() and time.monotonic() < deadline
        os.kill(engine.pids()["completion"], signal.SIGKILL)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        (out,) = outs
        assert out.request_id == "victim"
        assert "the completion engine" in out.error and "exited with code -9" in out.error, out.error
        assert engine.restarts == {"prompt": 0, "completion": 1}
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert_same({str(i): o for i, o in enumerate(got)}, {str(i): o for i, o in enumerate(want)})


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_ticks(pid: int) -> int:
    """The process's user + system CPU time so far (all its threads), in clock ticks."""
    fields = proc_stat(pid)
    return int(fields[11]) + int(fields[12])


def kill_and_wait(pid: int) -> None:
    """SIGKILL an engine process and wait until it is gone (reapable: its pipes closed, everything it
    wrote readable) without letting the front read anything meanwhile, and without reaping it.

    /proc shows the main thread as a zombie ("Z") while its other threads are still exiting; the
    front's `waitpid` sees the exit only once the whole thread group is gone, which `WNOWAIT` asks."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def wait_until_idle(pid: int, before: int, timeout_s: float = 120.0) -> None:
    """Until the process has worked since `before` ticks and then used no CPU for a whole second."""
    deadline = time.monotonic() + timeout_s
    last = cpu_ticks(pid)
    while True:
        assert time.monotonic() < deadline, "the decode engine never went idle"
        time.sleep(1.0)
        now = cpu_ticks(pid)
        if now == last > before:
            return
        last = now


@pytest.mark.slow
def test_what_a_dead_decode_engine_sent_before_it_died_is_kept(micro_checkpoint):
    """The front may see a decode engine's exit before it has read all it sent. Here the decode engine is
    stopped while the front forwards it hand-offs (8 blocks: the others are held), finishes them, and is
    killed before the front reads a word of it: the requests it finished come out whole instead of failing
    with it, and the held ones are decoded once, by the restarted engine."""
    with LLM(str(micro_checkpoint), async_scheduling=False, **FRONT) as llm:
        want = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    with LLM(str(micro_checkpoint), disaggregation="shm", **FRONT) as llm:
        engine = llm.engine
        pid = engine.pids()["completion"]
        os.kill(pid, signal.SIGSTOP)
        try:
            for i, p in enumerate(PROMPTS):
                engine.add_request(str(i), None, GREEDY, prompt_token_ids=p)
            ids = [str(i) for i in range(len(PROMPTS))]
            deadline = time.monotonic() + 120
            while not {engine.stage_of(r) for r in ids} <= {"held", "sent"}:  # all prefilled
                assert not engine.step() and time.monotonic() < deadline
            sent = [r for r in ids if engine.stage_of(r) == "sent"]
            assert sent
            before = cpu_ticks(pid)
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until_idle(pid, before)  # it finished what it was sent; its outputs wait in the pipe
        kill_and_wait(pid)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step())
        assert engine.restarts == {"prompt": 0, "completion": 1}
    assert_same(outs, {str(i): o for i, o in enumerate(want)})


@pytest.mark.slow
def test_a_hand_off_in_transit_to_a_decode_engine_that_dies_is_held_again_once(micro_checkpoint):
    """A record forwarded to a decode engine that dies before it reads it was not that engine's request:
    it goes to the restarted engine and comes out once, as a NORMAL engine's. In transit to a second
    engine that dies, it fails (it may be what kills them)."""
    with LLM(str(micro_checkpoint), async_scheduling=False, **FRONT) as llm:
        want = llm.generate(prompt_token_ids=PROMPTS[2:], sampling_params=GREEDY, use_tqdm=False)
    with LLM(str(micro_checkpoint), disaggregation="shm", **FRONT) as llm:
        engine = llm.engine

        def kill_decode_engine_with_in_transit(rid: str) -> None:
            """Stop the decode engine, let the front forward `rid`'s record to it, then kill it."""
            pid = engine.pids()["completion"]
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 120
            while engine.stage_of(rid) != "sent":
                assert not engine.step() and time.monotonic() < deadline
            kill_and_wait(pid)

        engine.add_request("a", None, GREEDY, prompt_token_ids=PROMPTS[2])
        kill_decode_engine_with_in_transit("a")
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert engine.restarts == {"prompt": 0, "completion": 1}
        assert_same({o.request_id: o for o in outs}, {"a": want[0]})

        engine.add_request("b", None, GREEDY, prompt_token_ids=PROMPTS[3])
        kill_decode_engine_with_in_transit("b")
        engine._watch()  # the front finds the exit: "b" is held again for the restarted engine
        assert engine.stage_of("b") == "held" and engine.restarts["completion"] == 2
        kill_decode_engine_with_in_transit("b")
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        (out,) = outs
        assert out.request_id == "b" and "the completion engine" in out.error and "code -9" in out.error
        assert engine.restarts == {"prompt": 0, "completion": 3}
        got = llm.generate(prompt_token_ids=PROMPTS[3:], sampling_params=GREEDY, use_tqdm=False)
    assert_same({"b": got[0]}, {"b": want[1]})
