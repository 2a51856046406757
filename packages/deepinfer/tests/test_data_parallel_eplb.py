"""Run-time EPLB inside the data-parallel engine (engine/data_parallel.py, engine spec §7.5) on 2 CPU
processes (gloo, torch all-to-all: exact numerics).

The checkpoint is the micro public V4 with the selection bias of experts 0 and 1 of its score-routed
MoE layer raised, so every token picks both (the bias only selects; the weights stay the unbiased
scores). Without redundant slots, EP rank 0 holds experts {0, 1} and does all of that layer's routed
work; the rebalance must move weights so the two ranks share it. Reference: the single-process engine
on the same checkpoint: every request's token ids, logprobs and top logprobs must be bitwise equal
although the experts move between the ranks in the middle of the run.
"""

import shutil

import pytest
import torch
from deepinfer import LLM, SamplingParams
from outputs_common import assert_same
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.distributed

PROMPTS = [list(range(1, 30)), [3, 4], [7, 8, 9, 10, 11], [12, 40, 41] * 4, [500, 2, 77]]
MAX_TOKENS = [4, 11, 7, 2, 9]
GREEDY = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in MAX_TOKENS]
SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m, logprobs=1) for m in MAX_TOKENS]
HOT = [0, 1]
EXPERT_ELEMENTS = 64 * 32  # hidden x moe_intermediate of one expert matrix (micro V4)
EPLB_ENV = {
    "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "16",  # first rebalance after 4 counted steps
    "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "4",
    "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "0",  # 4 experts, 2 slots per rank: rank 0 holds {0, 1}
    "DEEPINFER_MOE_LB_STAT_INTERVAL": "1",  # measured balance gathered every step
    "DEEPINFER_EP_BACKEND": "torch",
}


@pytest.fixture(scope="module")
def skewed_checkpoint(micro_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-micro-hot") / "ckpt"
    shutil.copytree(micro_checkpoint, path)
    tensors = load_file(str(path / "model.safetensors"))
    bias = tensors["layers.1.ffn.gate.bias"]  # the score-routed layer (layer 0 is hash-routed)
    bias[HOT] += 10.0
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def reference(skewed_checkpoint):
    with LLM(str(skewed_checkpoint), async_scheduling=False) as llm:
        greedy = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        sampled = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SAMPLED, use_tqdm=False)
    return {"greedy": greedy, "sampled": sampled}


def _dp_llm(path, use_async: bool, monkeypatch, env=None, **kw):
    for k, v in {**EPLB_ENV, **(env or {})}.items():
        monkeypatch.setenv(k, v)  # the rank processes are spawned with this environment
    return LLM(
        str(path), data_parallel_size=2, expert_parallel_size=2, async_scheduling=use_async,
        distributed_timeout=60, **kw,
    )  # fmt: skip


def _check_rebalanced(llm, planned_gain: bool):
    stats, ranks = llm.engine.stats, llm.engine._rank_stats
    # lockstep: every forward (real or idle) of every rank ran one EPLB step, with the same flags
    assert [r["eplb_steps"] for r in ranks] == [r["forwards"] for r in ranks]
    assert ranks[0]["eplb_steps"] == ranks[1]["eplb_steps"] == stats.eplb_steps > 0
    assert ranks[0]["eplb_prompt_steps"] == ranks[1]["eplb_prompt_steps"] == stats.eplb_prompt_steps > 0
    assert stats.eplb_rebalances >= 1 and stats.eplb_layers_changed >= 1
    # no redundant slots: a changed layer swaps experts between the ranks, so at least two experts'
    # w1, w3, w2 (FP32 on the CPU) cross the group
    assert stats.eplb_bytes_moved >= 2 * 3 * EXPERT_ELEMENTS * 4
    # planned on the last rebalance's window (peak / mean rank load, summed over steps and layers)
    assert stats.eplb_imbalance_before >= stats.eplb_imbalance_after >= 1.0
    if planned_gain:  # the only rebalance: its window saw the hot layer's load all on rank 0
        assert stats.eplb_imbalance_before > stats.eplb_imbalance_after
    # measured (the ranks' routed rows, all-gathered every step): better since the first rebalance
    assert 1.0 <= stats.eplb_moe_lb < stats.eplb_moe_lb_initial


def test_eplb_sync_loop_rebalances_mid_run_outputs_unchanged(skewed_checkpoint, reference, monkeypatch):
    with _dp_llm(skewed_checkpoint, False, monkeypatch) as llm:
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        assert_same(got, reference["greedy"])
        _check_rebalanced(llm, planned_gain=True)
        assert llm.engine.stats.eplb_rebalances == 1  # 1 prefill step, then 10 decode steps


def test_eplb_async_loop_after_prefill_mode_greedy_and_sampled(skewed_checkpoint, reference, monkeypatch):
    # Prefill steps counted, a rebalance right after each prefill (on the next decode step).
    env = {"DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE": "1"}
    with _dp_llm(skewed_checkpoint, True, monkeypatch, env) as llm:
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        assert_same(got, reference["greedy"])
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SAMPLED, use_tqdm=False)
        assert_same(got, reference["sampled"])
        _check_rebalanced(llm, planned_gain=False)
        assert llm.engine.stats.eplb_rebalances >= 2  # one after each run's prefill


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.usefixtures("deep_ep")
def test_eplb_counts_and_rebalance_through_deepep_on_cuda(skewed_checkpoint, monkeypatch, first_token_close):
    # DeepEP's dispatch fills the EPLB counts (per local slot, from its receive counts): a rebalance
    # that moves weights needs them. BF16 rows and combine: the first token's logprobs (same context
    # in both runs) agree to a BF16-sized tolerance, not bitwise.
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5) for _ in PROMPTS]
    with LLM(str(skewed_checkpoint), device="cuda", async_scheduling=False) as llm:
        want = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    env = {"DEEPINFER_EP_BACKEND": "deepep"}
    with _dp_llm(skewed_checkpoint, True, monkeypatch, env, device="cuda") as llm:
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        _check_rebalanced(llm, planned_gain=False)
    first_token_close(got, want)
