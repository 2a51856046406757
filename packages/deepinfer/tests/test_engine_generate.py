"""End-to-end generation through LLM / LLMEngine on a small random checkpoint."""

import pytest
import torch
from deepinfer import LLM, SamplingParams

# token-id prompts (the micro model has a 512-token vocabulary; ids decode with the real tokenizer)
PROMPTS = [[0, 40, 77, 91, 12, 300, 5], [0, 7, 7, 8, 9], [0, 450, 33, 98, 140, 21, 66, 71, 250]]


@pytest.fixture(scope="module")
def llm_sync(micro_checkpoint):
    with LLM(model=str(micro_checkpoint), async_scheduling=False, block_size=16, max_model_len=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def llm_async(micro_checkpoint):
    with LLM(model=str(micro_checkpoint), async_scheduling=True, block_size=16, max_model_len=256) as llm:
        yield llm


def _greedy_reference(model, ids, n):
    ids = list(ids)
    out = []
    for _ in range(n):
        tok = int(torch.argmax(model.forward(torch.tensor(ids))[-1]))
        out.append(tok)
        ids.append(tok)
    return out


def test_greedy_matches_naive_loop_and_async_matches_sync(llm_sync, llm_async):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    sync = llm_sync.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    asyn = llm_async.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    for s, a in zip(sync, asyn):
        assert s.error is None and a.error is None
        ref = _greedy_reference(llm_sync.engine.model, s.prompt_token_ids, 6)
        assert s.outputs[0].token_ids == ref
        assert a.outputs[0].token_ids == ref
        assert s.outputs[0].text == llm_sync.get_tokenizer().decode(ref)
        assert s.outputs[0].finish_reason == "length"
        m = s.metrics
        assert m.ttft is not None and m.ttft >= 0 and m.tpot is not None and m.num_output_tokens == 6
    assert llm_async.engine.stats.steps > 0


def test_seeded_sampling_sync_async_and_batch_composition(llm_sync, llm_async):
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, seq_seed=100 + i, ignore_eos=True)
        for i in range(3)
    ]
    sync = [
        o.outputs[0].token_ids
        for o in llm_sync.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    ]
    asyn = [
        o.outputs[0].token_ids
        for o in llm_async.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    ]
    assert sync == asyn
    # the same request alone (different batch) gives the same tokens
    alone = (
        llm_async.generate(prompt_token_ids=PROMPTS[1], sampling_params=params[1], use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert alone == sync[1]


def test_n_samples_distinct_when_sampling_identical_when_greedy(llm_async):
    sampled = llm_async.generate(
        prompt_token_ids=PROMPTS[0],
        sampling_params=SamplingParams(n=4, temperature=1.5, max_tokens=4, seq_seed=7),
        use_tqdm=False,
    )
    seqs = [tuple(c.token_ids) for c in sampled[0].outputs]
    assert len(seqs) == 4 and len(set(seqs)) == 4
    assert [c.index for c in sampled[0].outputs] == [0, 1, 2, 3]
    greedy = llm_async.generate(
        prompt_token_ids=PROMPTS[0],
        sampling_params=SamplingParams(n=3, temperature=0.0, max_tokens=4),
        use_tqdm=False,
    )
    assert len({tuple(c.token_ids) for c in greedy[0].outputs}) == 1


def test_stop_string_cuts_text_exactly(llm_sync):
    base = llm_sync.generate(
        prompt_token_ids=PROMPTS[2],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    text = base[0].outputs[0].text
    assert len(text) >= 6
    stop = text[3:6]
    cut = text.index(stop)
    out = llm_sync.generate(
        prompt_token_ids=PROMPTS[2],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )
    c = out[0].outputs[0]
    assert c.text == text[:cut]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    kept = llm_sync.generate(
        prompt_token_ids=PROMPTS[2],
        sampling_params=SamplingParams(
            temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )
    assert kept[0].outputs[0].text == text[: cut + len(stop)]


def test_stop_token_ids_and_logprobs(llm_sync):
    base = llm_sync.generate(
        prompt_token_ids=PROMPTS[0],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
        use_tqdm=False,
    )
    c = base[0].outputs[0]
    assert len(c.logprobs) == 6 and len(c.top_logprobs) == 6
    for tok, lp, top in zip(c.token_ids, c.token_logprobs, c.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(lp, abs=1e-5)  # greedy: chosen is the top
        assert tok in top
    stop_tok = c.token_ids[2]
    out = llm_sync.generate(
        prompt_token_ids=PROMPTS[0],
        sampling_params=SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_tok]
        ),
        use_tqdm=False,
    )
    first = c.token_ids.index(stop_tok)
    assert out[0].outputs[0].token_ids == c.token_ids[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop_tok


def test_bad_requests_fail_alone(llm_async):
    vocab = llm_async.engine.vocab_size
    params = [
        SamplingParams(temperature=0.0, max_tokens=3),
        {"temperature": 0.5, "top_p": 2.0},  # invalid: fails alone
        SamplingParams(temperature=0.0, max_tokens=3),
    ]
    outs = llm_async.generate(
        prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False, raise_on_error=False
    )
    assert outs[1].error is not None and "top_p" in outs[1].error
    assert all(outs[i].error is None and len(outs[i].outputs[0].token_ids) == 3 for i in (0, 2))

    outs = llm_async.generate(
        prompt_token_ids=[[5] * 10, [vocab + 3] * 10, [], list(range(3, 300))],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=2),
        use_tqdm=False,
        raise_on_error=False,
    )
    assert outs[0].error is None
    assert "prompt_token_ids" in outs[1].error
    assert "empty" in outs[2].error
    assert "max_model_len" in outs[3].error
    with pytest.raises(ValueError, match="request 1"):
        llm_async.generate(prompt_token_ids=[[5] * 10, [vocab] * 10], raise_on_error=True, use_tqdm=False)


def test_abort_frees_blocks(micro_checkpoint):
    with LLM(model=str(micro_checkpoint), block_size=16, max_model_len=256) as llm:
        engine = llm.engine
        free_before = engine.scheduler_stats()["num_free_blocks"]
        p = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", None, p, prompt_token_ids=prompt)
        done = []
        for _ in range(3):
            done += engine.step()
        assert engine.scheduler_stats()["num_free_blocks"] < free_before
        assert engine.abort_request("r1")
        for _ in range(2):
            done += engine.step()
        assert engine.abort_request("r0") and engine.abort_request("r2")
        while engine.has_unfinished_requests():
            done += engine.step()
        by_id = {o.request_id: o for o in done}
        assert sorted(by_id) == ["r0", "r1", "r2"]
        for o in by_id.values():
            assert o.outputs[0].finish_reason == "abort"
            assert 0 < len(o.outputs[0].token_ids) < 50
        assert engine.scheduler_stats()["num_free_blocks"] == free_before
        assert not engine.abort_request("r1")  # unknown / already finished


def test_text_prompts_and_chat_template(real_vocab_checkpoint):
    with LLM(model=str(real_vocab_checkpoint), block_size=16, max_model_len=128) as llm:
        tok = llm.get_tokenizer()
        out = llm.generate("Hello, world! 你好", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert out[0].prompt_token_ids == [0] + tok.encode("Hello, world! 你好", add_special_tokens=False)
        assert len(out[0].outputs[0].token_ids) == 2
        out = llm.chat(
            [{"role": "user", "content": "Say hello"}],
            SamplingParams(max_tokens=1, temperature=0),
            use_tqdm=False,
        )
        ids = out[0].prompt_token_ids
        assert (
            ids[0] == 0
            and tok.token_to_id("<｜User｜>") in ids
            and ids[-1] == tok.token_to_id("<｜Assistant｜>")
        )


def test_ctrl_c_aborts_cleanly_and_engine_stays_usable(micro_checkpoint):
    with LLM(model=str(micro_checkpoint), block_size=16, max_model_len=256) as llm:
        engine = llm.engine
        free_before = engine.scheduler_stats()["num_free_blocks"]
        real_step, calls = engine.step, []

        def interrupted_step():
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real_step()

        engine.step = interrupted_step
        with pytest.raises(KeyboardInterrupt):
            llm.generate(
                prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=20), use_tqdm=False
            )
        engine.step = real_step
        assert not engine.has_unfinished_requests()
        assert engine.scheduler_stats()["num_free_blocks"] == free_before
        out = llm.generate(
            prompt_token_ids=PROMPTS[0], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False
        )
        assert out[0].error is None and len(out[0].outputs[0].token_ids) == 2


def test_stats_logged_every_interval(micro_checkpoint, monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_LOGGING_INTERVAL_STEP", "1")
    with LLM(model=str(micro_checkpoint), block_size=16, max_model_len=64, disable_log_stats=False) as llm:
        with caplog.at_level("INFO", logger="deepinfer"):
            llm.generate(
                prompt_token_ids=PROMPTS[0], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False
            )
    lines = [r.getMessage() for r in caplog.records if r.name == "deepinfer"]
    assert lines and all("KV usage" in line for line in lines)


@pytest.mark.parametrize("use_async", [False, True])
def test_preemption_by_recompute_gives_the_same_tokens(micro_checkpoint, use_async):
    params = [
        SamplingParams(temperature=0.7, max_tokens=24, seq_seed=11 + i, ignore_eos=True) for i in range(3)
    ]
    results = []
    for num_kv_blocks in (64, 5):  # 5 blocks of 16 cannot hold three 30-token sequences at once
        with LLM(
            model=str(micro_checkpoint),
            block_size=16,
            max_model_len=64,
            num_kv_blocks=num_kv_blocks,
            async_scheduling=use_async,
        ) as llm:
            outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
            preemptions = llm.engine.scheduler_stats()["num_preemptions"]
    assert preemptions > 0
    assert results[0] == results[1]


def test_golden_tokens_are_emitted_then_sampling_continues(llm_sync):
    golden = [11, 22, 33]
    out = llm_sync.generate(
        prompt_token_ids=PROMPTS[0],
        sampling_params=SamplingParams(
            temperature=0.0, max_tokens=5, ignore_eos=True, golden_token_ids=golden, logprobs=0
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids[:3] == golden
    # after the forced prefix, greedy decoding continues from it
    ref = _greedy_reference(llm_sync.engine.model, PROMPTS[0] + golden, 2)
    assert out.token_ids[3:] == ref
    forced_lp = torch.log_softmax(llm_sync.engine.model.forward(torch.tensor(PROMPTS[0]))[-1].double(), -1)[
        11
    ]
    assert out.token_logprobs[0] == pytest.approx(float(forced_lp), abs=1e-5)
