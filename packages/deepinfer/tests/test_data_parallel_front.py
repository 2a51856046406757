"""The data-parallel front (engine/data_parallel.py) on 2 CPU processes: start-up and step timeouts kept
apart, a frozen rank named while the healthy one still works (EP 1) or waits for it in a collective
(EP 2), per-request abort, scheduler statistics summed over the ranks, and a clean interpreter exit with
or without close().

Ranks are frozen with SIGSTOP, as a hung host would be: the process stays alive and sends nothing.
"""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from deepinfer import LLM, SamplingParams
from deepinfer.engine_args import EngineArgs

pytestmark = pytest.mark.distributed

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13, 14]]
SHORT = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
# 4 samples of 500 tokens one after the other (max_num_seqs=1): 2000 steps, far longer than a freeze
# takes to be noticed
LONG = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True, n=4)
STEP_TIMEOUT = 5  # seconds; the ranks take longer than this to start


@pytest.fixture(scope="module")
def dp(micro_checkpoint):
    # EP 1: nothing couples the ranks' steps, so only the front can notice a frozen one
    llm = LLM(
        str(micro_checkpoint),
        data_parallel_size=2,
        expert_parallel_size=1,
        distributed_timeout=STEP_TIMEOUT,
        max_num_seqs=1,
    )
    yield llm
    llm.close()


def _drain(engine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    return outs


def test_startup_timeout_is_validated_and_a_flag():
    EngineArgs(distributed_startup_timeout=1, device="cpu")
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="distributed_startup_timeout must be an integer >= 1"):
            EngineArgs(distributed_startup_timeout=bad, device="cpu")
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--distributed-startup-timeout", "90"])
    assert EngineArgs.from_cli_args(args).distributed_startup_timeout == 90


def test_ranks_late_to_start_are_named(micro_checkpoint):
    t0 = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"data-parallel ranks 0, 1 not ready after 1 s \(distributed_startup_timeout\)"
    ):
        LLM(str(micro_checkpoint), data_parallel_size=2, distributed_startup_timeout=1)
    assert time.monotonic() - t0 < 30


def test_short_step_timeout_does_not_bound_the_start_and_stats_sum_the_ranks(dp, micro_checkpoint):
    engine = dp.engine
    got = dp.generate(prompt_token_ids=PROMPTS, sampling_params=SHORT, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in got)
    with LLM(str(micro_checkpoint)) as single:
        single.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SHORT, use_tqdm=False)
        single_stats = single.engine.scheduler_stats()
    stats = engine.scheduler_stats()
    assert set(stats) == set(single_stats) | {"ranks"}
    ranks = stats["ranks"]
    assert len(ranks) == 2 and all(set(r) == set(single_stats) for r in ranks)
    assert all(r["num_finished"] == 2 for r in ranks)  # two requests on each rank
    for key in ("num_finished", "num_blocks", "num_free_blocks", "num_steps", "prefix_cache_query_tokens"):
        assert stats[key] == ranks[0][key] + ranks[1][key], key
    assert stats["num_free_blocks"] == stats["num_blocks"] > 0 and stats["kv_usage"] == 0.0
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_abort_one_request_through_the_front(dp):
    engine = dp.engine
    aborted_before = engine.scheduler_stats()["num_aborted"]
    engine.add_request("long0", None, LONG, prompt_token_ids=PROMPTS[0])
    engine.add_request("long1", None, LONG, prompt_token_ids=PROMPTS[1])
    engine.add_request("queued", None, SHORT, prompt_token_ids=PROMPTS[2])
    assert engine.abort_request("queued")  # never left the front
    assert not engine.abort_request("no-such-request")
    outs = {o.request_id: o for o in engine.step()}  # dispatches long0 / long1
    assert outs["queued"].outputs[0].finish_reason == "abort" and outs["queued"].outputs[0].token_ids == []
    assert engine.abort_request("long0") and engine.abort_request("long1")
    outs = _drain(engine)
    assert sorted(outs) == ["long0", "long1"]
    for o in outs.values():
        assert o.error is None and len(o.outputs) == 4
        for c in o.outputs:
            assert c.finish_reason == "abort" and len(c.token_ids) < LONG.max_tokens
    stats = engine.scheduler_stats()
    assert stats["num_aborted"] - aborted_before == 8  # 2 requests x 4 samples, one on each rank
    assert stats["num_free_blocks"] == stats["num_blocks"]  # their blocks are back
    assert not engine.abort_request("long0")  # finished: the front no longer holds it
    got = dp.generate(prompt_token_ids=PROMPTS[:2], sampling_params=SHORT, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in got)  # the ranks go on serving


def test_a_frozen_rank_is_named_while_the_other_still_works(dp):
    engine = dp.engine
    engine.add_request("on-rank-0", None, LONG, prompt_token_ids=PROMPTS[0])
    engine.add_request("on-rank-1", None, LONG, prompt_token_ids=PROMPTS[1])
    engine.step()  # dispatched: one request per rank (equal costs: rank 0, then rank 1)
    victim = engine._procs[1].pid
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as e:
            while engine.has_unfinished_requests():
                engine.step()
        waited = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):  # the front has killed it already
            os.kill(victim, signal.SIGCONT)
    message = str(e.value)
    assert "data-parallel rank 1 sent nothing for" in message and "frozen or hung" in message, message
    assert "rank 0" not in message, message  # the healthy rank is not blamed
    assert f"distributed_timeout={STEP_TIMEOUT} s" in message
    assert waited < STEP_TIMEOUT + 10, waited
    # noticed while rank 0 was still generating its 4 x 500 tokens, not after it had finished
    assert "on-rank-0" in engine._outstanding
    with pytest.raises(RuntimeError, match="cannot be used"):
        engine.step()


@pytest.mark.slow  # (about 60 s: two ranks start, then the timeout and the kill of a stopped process)
def test_a_frozen_rank_is_named_while_the_other_waits_for_it_in_a_collective(micro_checkpoint):
    # EP 2: the healthy rank's next vote (or all-to-all) needs the frozen one, so it blocks there; it is
    # alive (beats) but makes no progress, and the front must blame the rank that went silent.
    with LLM(
        str(micro_checkpoint), data_parallel_size=2, expert_parallel_size=2,
        distributed_timeout=STEP_TIMEOUT, max_num_seqs=1,
    ) as llm:  # fmt: skip
        engine = llm.engine
        engine.add_request("on-rank-0", None, LONG, prompt_token_ids=PROMPTS[0])
        engine.add_request("on-rank-1", None, LONG, prompt_token_ids=PROMPTS[1])
        engine.step()  # dispatched: one request per rank
        victim = engine._procs[1].pid
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises(TimeoutError) as e:
                while engine.has_unfinished_requests():
                    engine.step()
            failed_at = time.monotonic()
        finally:
            with contextlib.suppress(ProcessLookupError):  # the front has killed it already
                os.kill(victim, signal.SIGCONT)
        message = str(e.value)
        assert "data-parallel rank 1 sent nothing for" in message and "frozen or hung" in message, message
        assert "rank 0 sent nothing" not in message, message  # the waiting rank is not blamed
        if "rank 0" in message:  # named at most as the one waiting
            assert "rank 0 alive but made no progress" in message, message
            assert "(waiting for the silent rank)" in message, message
        assert failed_at - t0 < STEP_TIMEOUT + 10, failed_at - t0
        # rank 0 was alive to the end (beating) but blocked: no progress since the freeze
        assert engine._heard_at[0] > t0 + STEP_TIMEOUT - 2, (engine._heard_at[0] - t0, message)
        assert engine._progress_at[0] < t0 + 3, engine._progress_at[0] - t0
        assert "on-rank-0" in engine._outstanding


@pytest.mark.slow
def test_interpreter_exit_is_clean_with_and_without_close(micro_checkpoint, tmp_path):
    # Both engines are kept alive to the very end of the interpreter (held by `sys`, which is torn
    # down last): what stops their ranks must not depend on modules already torn down by then.
    script = tmp_path / "exit.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from deepinfer import LLM, SamplingParams

            if __name__ == "__main__":
                params = SamplingParams(temperature=0, max_tokens=2)
                closed = LLM({str(micro_checkpoint)!r}, data_parallel_size=2)
                closed.generate(prompt_token_ids=[[1, 2], [3, 4]], sampling_params=params, use_tqdm=False)
                closed.close()
                left_open = LLM({str(micro_checkpoint)!r}, data_parallel_size=2)
                left_open.generate(prompt_token_ids=[[1, 2], [3, 4]], sampling_params=params, use_tqdm=False)
                sys.kept = [closed.engine, left_open.engine]
                print("done", flush=True)
            """
        )
    )
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "done"
    assert "Exception ignored" not in run.stderr and "Traceback" not in run.stderr, run.stderr
