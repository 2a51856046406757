"""Batch-invariant mode on the public DeepSeek-V4 model (whose forward runs under torch.inference_mode):
the engine serves it, and a request's greedy tokens and logprobs are the same alone and in a batch.
(The V4.1 engine checks are tests/test_repro_engine_batch_invariant.py.)"""

from __future__ import annotations

import pytest
from deepinfer import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [3, 4], [100, 101, 102] * 5]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_public_v4_outputs_are_batch_invariant(micro_checkpoint, monkeypatch, async_scheduling):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    with LLM(str(micro_checkpoint), async_scheduling=async_scheduling, max_num_batched_tokens=16) as llm:
        alone = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=PARAMS, use_tqdm=False)[0]
        mixed = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False)[0]
    for out in (alone, mixed):
        assert out.error is None, out.error
        assert len(out.outputs[0].token_ids) == PARAMS.max_tokens
    assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids
    assert alone.outputs[0].logprobs == mixed.outputs[0].logprobs
    assert alone.outputs[0].top_logprobs == mixed.outputs[0].top_logprobs
