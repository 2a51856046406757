"""`deepinfer bench decode` with data parallelism measures on the rank processes (2 gloo ranks, EP 2,
run-time EPLB on a short interval): `dp` is the number of rank processes that reported steps, and the
steps in which the ranks' EPLB flushed its load statistic are the ones dropped.

Reference for the dropping: in the synchronous loop every step of an EP rank runs exactly one forward
and every forward one EPLB step, so the statistic is gathered after forwards k, 2k, 3k, ... (k =
DEEPINFER_MOE_LB_STAT_INTERVAL): a step must be flagged exactly when its forward count is a multiple
of k.
"""

import json
import os

import pytest
from deepinfer import EngineArgs
from deepinfer.bench.engine_driver import Driver
from deepinfer.bench.phases import DecodeConfig
from deepinfer.bench.rank_phases import run_decode_ranks
from deepinfer.engine.data_parallel import DataParallelEngine

pytestmark = pytest.mark.distributed

LB_INTERVAL = 3
EPLB_ENV = {
    "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "1000",  # EPLB on; its first rebalance after the run
    "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "4",
    "DEEPINFER_MOE_LB_STAT_INTERVAL": str(LB_INTERVAL),
    "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "0",
    "DEEPINFER_EP_BACKEND": "torch",
}


@pytest.mark.slow  # about a minute on two loaded cores: the CLI, the ceilings and 2 rank processes
def test_bench_decode_rows_come_from_the_rank_processes(micro_checkpoint, tmp_path, monkeypatch):
    from deepinfer.cli import main

    for k, v in {**EPLB_ENV, "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "8"}.items():
        monkeypatch.setenv(k, v)  # rebalances too, in the window (the async loop: the default)
    argv = ["bench", "decode", "--model", str(micro_checkpoint), "--data-parallel-size", "2"]
    argv += ["--expert-parallel-size", "2", "--batches", "4", "--decode-context", "6", "--nextn", "0"]
    argv += ["--warmup-steps", "1", "--measure-steps", "12", "--no-progress", "--no-plot"]
    argv += ["--results-dir", str(tmp_path), "--name", "t", "--num-threads", "1"]
    assert main(argv) == 0
    (row,) = json.loads((tmp_path / "t.json").read_text())
    assert row["dp"] == 2 and len(set(row["rank_pids"])) == 2 and os.getpid() not in row["rank_pids"]
    assert row["batch"] == 4 and row["batch_per_rank"] == 2 and len(row["rank_ms_per_step"]) == 2
    assert row["eplb_objects_watched"] == 2  # both ranks' EPLB reported its events
    assert row["dropped_flagged_intervals"] > 0 and row["intervals"] > 0
    assert row["intervals"] + row["dropped_flagged_intervals"] == 12
    assert row["window_intervals_with_moe_lb_flush"] > 0 and row["eplb_rebalances_total"] > 0
    # per GPU: the world's tokens over the slowest rank's step time, shared by the 2 ranks
    assert row["ms_per_step"] > 0 and row["measured_tok_per_s_per_gpu"] == pytest.approx(
        row["batch"] / (row["ms_per_step"] / 1e3) / 2
    )


def test_sync_loop_drops_exactly_the_steps_whose_forward_flushed(micro_checkpoint, monkeypatch):
    for k, v in EPLB_ENV.items():
        monkeypatch.setenv(k, v)
    args = EngineArgs(
        model=str(micro_checkpoint), data_parallel_size=2, expert_parallel_size=2, async_scheduling=False,
        max_num_seqs=2, max_model_len=64, num_threads=1, distributed_timeout=60,
    )  # fmt: skip
    engine = DataParallelEngine(args)
    try:
        cfg = DecodeConfig(batches=[2], context=5, warmup_steps=1, measure_steps=9)
        (row,) = run_decode_ranks(Driver(engine, 0), cfg, token_budget=4096)
        traces = engine.step_traces()
    finally:
        engine.close()
    assert row["dp"] == 2 and row["batch_per_rank"] == 1
    flagged_steps = 0
    for t in traces:
        assert t["identity"]["eplb"] and not t["identity"]["async_loop"]
        steps = t["steps"]
        for prev, step in zip(steps, steps[1:]):
            if step["forwards"] == prev["forwards"] + 1:  # a step that ran one forward
                assert bool(step["events"]) == (step["forwards"] % LB_INTERVAL == 0), (prev, step)
        flagged_steps += sum(bool(s["events"]) for s in steps)
        assert t["events"]["moe_lb_flush"] == sum(s["events"].count("moe_lb_flush") for s in steps)
    assert flagged_steps > 0
    # 9 consecutive one-forward steps: 3 of them end on a multiple of 3
    assert (row["intervals"], row["dropped_flagged_intervals"]) == (6, 3)
    assert row["window_intervals_with_moe_lb_flush"] == 3 and row["window_intervals_with_eplb_rebalance"] == 0
