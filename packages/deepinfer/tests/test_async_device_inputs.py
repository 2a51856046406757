"""The asynchronous loop's device-fed steps (engine/step_pipeline.py): a decode step whose input ids are
the previous step's tokens is launched before those tokens are read back, its ids read on the device.

What a user relies on: the tokens, log-probabilities and failures are exactly those of the synchronous
loop and of the host-filled asynchronous loop (DEEPINFER_ASYNC_DEVICE_INPUTS=0), for every kind of row
(greedy, seeded sampling with filters, logprobs, min_tokens bans, teacher-forced prefixes), while the
batch changes as requests finish; and one bad row fails alone.
"""

import pytest
from deepinfer import LLM, SamplingParams
from deepinfer.engine.step_io import StepInput
from deepinfer.engine.step_pipeline import StepPipeline

PROMPTS = [[0, 40, 77, 91, 12, 300, 5], [0, 7, 7, 8, 9], [0, 450, 33, 98, 140, 21, 66, 71, 250], [0, 3, 4]]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_tokens=6, seq_seed=11, logprobs=2),
        SamplingParams(
            temperature=0.8, min_p=0.05, max_tokens=12, min_tokens=4, seq_seed=12, ignore_eos=True
        ),
        SamplingParams(temperature=0.0, max_tokens=7, golden_token_ids=[21, 22, 23], logprobs=0),
    ]


def _run(checkpoint, monkeypatch, async_scheduling: bool, device_inputs: bool):
    monkeypatch.setenv("DEEPINFER_ASYNC_DEVICE_INPUTS", "1" if device_inputs else "0")
    with LLM(
        model=str(checkpoint), async_scheduling=async_scheduling, block_size=16, max_model_len=256
    ) as llm:
        engine = llm.engine
        if engine.pipeline is not None:  # on the CPU a step is done when launched: chain every step anyway
            engine.pipeline.always_chain = True
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_params(), use_tqdm=False)
        chained = engine.pipeline.chained_launches if engine.pipeline is not None else 0
        return [(o.error, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], (
            chained,
            engine.worker.device_fed_steps,
        )


def test_device_fed_steps_give_the_tokens_of_the_host_filled_loops(micro_checkpoint, monkeypatch):
    sync, (sync_chained, _) = _run(micro_checkpoint, monkeypatch, False, True)
    host, (host_chained, host_fed) = _run(micro_checkpoint, monkeypatch, True, False)
    fed, (chained, fed_steps) = _run(micro_checkpoint, monkeypatch, True, True)
    assert all(err is None for err, _, _ in sync)
    assert fed == sync and host == sync
    assert sync[3][1][:3] == [21, 22, 23]  # (the forced prefix, fed from the host into the next step)
    assert sync_chained == 0 and host_chained == 0 and host_fed == 0
    # the decode steps after the first were launched behind the step before, their ids read on the device
    assert chained >= 8 and fed_steps >= 8


def test_a_step_the_device_has_finished_is_read_before_the_next_launch(micro_checkpoint, monkeypatch):
    """On the CPU every step is finished when launched: the pipeline then reads it first and fills the
    next step on the host (the engine gets each result as early as possible), unless told to chain."""
    monkeypatch.setenv("DEEPINFER_ASYNC_DEVICE_INPUTS", "1")
    kw = dict(async_scheduling=True, block_size=16, max_model_len=256, device="cpu")  # (a CPU property)
    with LLM(model=str(micro_checkpoint), **kw) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_params(), use_tqdm=False)
        assert llm.engine.pipeline.chained_launches == 0 and llm.engine.worker.device_fed_steps == 0
    assert all(o.error is None for o in outs) and len(outs[0].outputs[0].token_ids) == 9


def test_a_row_left_with_no_token_fails_alone(micro_checkpoint, monkeypatch):
    """Every token of one sampled row banned (min_tokens with every id a stop token): that request fails
    with the sampler's message, the others in the same steps finish as they would without it."""
    vocab = 512
    bad = SamplingParams(temperature=1.0, max_tokens=4, min_tokens=2, stop_token_ids=list(range(vocab)))
    good = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 2
    monkeypatch.setenv("DEEPINFER_ASYNC_DEVICE_INPUTS", "1")
    with LLM(model=str(micro_checkpoint), async_scheduling=True, block_size=16, max_model_len=256) as llm:
        llm.engine.pipeline.always_chain = True
        outs = llm.generate(
            prompt_token_ids=PROMPTS[:3], sampling_params=[good[0], bad, good[1]], use_tqdm=False
        )
        alone = llm.generate(prompt_token_ids=[PROMPTS[0], PROMPTS[2]], sampling_params=good, use_tqdm=False)
    assert outs[1].error is not None and "no token left" in outs[1].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [
        o.outputs[0].token_ids for o in alone
    ]


def test_pipeline_keeps_job_order_and_hands_a_launch_error_to_its_future(micro_checkpoint):
    with LLM(model=str(micro_checkpoint), async_scheduling=False, block_size=16, max_model_len=256) as llm:
        pipe = StepPipeline(llm.engine.worker)
        try:
            order = []
            first = pipe.submit(order.append, "a")
            broken = pipe.submit_step(StepInput(None, [], []))  # no batch: launch raises
            last = pipe.submit(lambda: order.append("b") or len(order))
            with pytest.raises(AttributeError):
                broken.result(timeout=30)
            assert first.result(timeout=30) is None and last.result(timeout=30) == 2 and order == ["a", "b"]
        finally:
            pipe.shutdown()
