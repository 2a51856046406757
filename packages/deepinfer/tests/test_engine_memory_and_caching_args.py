"""Engine args `gpu_memory_utilization`, `enable_prefix_caching` and `enforce_eager`."""

import logging

import pytest
import torch
from deepinfer import LLM, SamplingParams
from deepinfer.engine import kv_sizing
from deepinfer.engine.kv_sizing import kv_cache_blocks

GIB = 2**30


def _blocks(**kw):
    base = dict(
        device=torch.device("cuda"),
        block_size=16,
        max_model_len=4096,
        max_num_seqs=256,
        num_kv_blocks=None,
        gpu_memory_utilization=0.9,
        bytes_per_block=4 * 2**20,
    )
    return kv_cache_blocks(**(base | kw))


def test_cuda_kv_cache_is_sized_from_gpu_memory_utilization():
    # 80 GiB device, 30 GiB in use (weights, other processes): 0.9 x 80 - 30 = 42 GiB for the cache
    assert _blocks(mem_info=(50 * GIB, 80 * GIB)) == 42 * 256  # 42 GiB of 4 MiB blocks
    assert _blocks(gpu_memory_utilization=0.5, mem_info=(50 * GIB, 80 * GIB)) == 10 * 256
    # never more than max_num_seqs full-length sequences can use (256 blocks each here)
    assert _blocks(max_num_seqs=4, mem_info=(50 * GIB, 80 * GIB)) == 4 * 256 + 1
    # an explicit num_kv_blocks wins
    assert _blocks(num_kv_blocks=77, mem_info=(50 * GIB, 80 * GIB)) == 77


def test_too_little_memory_names_the_knob():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.4 leaves 0.00 GiB .*40.00 of 80.00 GiB"):
        _blocks(gpu_memory_utilization=0.4, mem_info=(40 * GIB, 80 * GIB))
    with pytest.raises(ValueError, match="one sequence of max_model_len=4096 needs 1.000 GiB"):
        _blocks(gpu_memory_utilization=0.5, mem_info=(40 * GIB + 512 * 2**20, 80 * GIB))


def test_cpu_ignores_gpu_memory_utilization_and_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(kv_sizing, "_warned_cpu", False)
    cpu = {"device": torch.device("cpu"), "mem_info": None}
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        assert _blocks(**cpu) == 256 * 64 + 1  # the default utilization: no warning
        assert not caplog.records
        assert _blocks(**cpu, gpu_memory_utilization=0.3) == 256 * 64 + 1
        assert _blocks(**cpu, gpu_memory_utilization=0.5) == 256 * 64 + 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "gpu_memory_utilization=0.3 is ignored on cpu" in warnings[0]


def test_prefix_caching_switch_is_honoured(micro_checkpoint):
    prompt = [[0, *range(10, 58)]]  # 49 tokens: three full 16-token blocks can be reused
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    got = {}
    for enabled in (True, False):
        with LLM(
            model=str(micro_checkpoint), block_size=16, max_model_len=128, enable_prefix_caching=enabled
        ) as llm:
            first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            second = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            assert first == second
            got[enabled] = (first, llm.engine.scheduler_stats()["prefix_cache_hit_tokens"])
    assert got[True][0] == got[False][0]  # the same tokens with and without reuse
    assert got[True][1] >= 48 and got[False][1] == 0


def test_engine_args_reach_the_command_line():
    import argparse

    from deepinfer import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--enforce-eager", "--no-enable-prefix-caching"]))
    assert args.enforce_eager is True and args.enable_prefix_caching is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_enforce_eager_and_memory_budget_on_cuda(micro_checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [[0, 40, 77, 91, 12]]
    with LLM(model=str(micro_checkpoint), device="cuda", max_model_len=128) as llm:
        assert llm.engine.runner.graphs is not None
        want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        per_block = llm.engine._kv_bytes_per_block()
        model = llm.engine.model
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    with LLM(model=str(micro_checkpoint), device="cuda", max_model_len=128, enforce_eager=True) as llm:
        assert llm.engine.runner.graphs is None
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # a utilization that leaves room for the weights and 40 blocks beyond what is in use now
    utilization = (total - free + weights + 40.5 * per_block) / total
    with LLM(
        model=str(micro_checkpoint), device="cuda", max_model_len=128, gpu_memory_utilization=utilization
    ) as llm:
        blocks = llm.engine.scheduler_stats()["num_blocks"]
        assert 20 <= blocks <= 41, blocks  # (allocator rounding takes a little of it)
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
