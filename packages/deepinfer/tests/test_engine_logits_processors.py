"""vLLM's sampling fields end to end on the micro model: penalties, logit bias, allowed ids and bad
words against a naive float64 greedy loop over the stateless model, in the direction they promise,
identical in the synchronous and asynchronous loops and whatever the batch."""

import math
import re

import pytest
import torch
from deepinfer import LLM, SamplingParams

PROMPTS = [[0, 40, 77, 91, 12, 300, 5], [0, 7, 7, 8, 9], [0, 450, 33, 98, 140, 21, 66, 71, 250]]
N = 10


@pytest.fixture(scope="module")
def llm_sync(micro_checkpoint, share_loaded_models):
    with LLM(model=str(micro_checkpoint), async_scheduling=False, block_size=16, max_model_len=128) as llm:
        yield llm


@pytest.fixture(scope="module")
def llm_async(micro_checkpoint, share_loaded_models):
    with LLM(model=str(micro_checkpoint), async_scheduling=True, block_size=16, max_model_len=128) as llm:
        yield llm


def generate(llm, params, prompts=PROMPTS):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for o in outs:
        assert o.error is None, o.error
    return [o.outputs[0] for o in outs]


def naive_processed(logits: list[float], p: SamplingParams, prompt: list[int], out: list[int]) -> list[float]:
    """vLLM's processors on one row in float64, from their definitions."""
    x = list(logits)
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(out):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


def naive_greedy(model, prompt, p: SamplingParams, n=N) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        logits = model.forward(torch.tensor(ids))[-1].double().tolist()
        x = naive_processed(logits, p, prompt, out)
        out.append(max(range(len(x)), key=lambda t: (x[t], -t)))
        ids.append(out[-1])
    return out


PROCESSED = [
    SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(
        temperature=0, max_tokens=N, ignore_eos=True, logit_bias={3: 2.0, 9: -1.0}, presence_penalty=-1
    ),
    SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, allowed_token_ids=list(range(100, 160))),
]


@pytest.mark.parametrize("index", range(len(PROCESSED)))
def test_greedy_with_processors_matches_a_naive_float64_loop(llm_sync, index):
    p = PROCESSED[index]
    model = llm_sync.engine.model
    got = generate(llm_sync, p)
    for prompt, c in zip(PROMPTS, got):
        assert c.token_ids == naive_greedy(model, prompt, p)


def test_penalties_push_in_their_direction(llm_sync):
    m = 24  # long enough for the random model to repeat itself

    def run(**kw):
        return generate(llm_sync, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **kw))

    base = run()
    assert any(len(set(c.token_ids)) < m for c in base)
    for prompt, c in zip(PROMPTS, run(repetition_penalty=100)):
        assert len(set(c.token_ids)) == m and not set(c.token_ids) & set(prompt)
    for b, f in zip(base, run(frequency_penalty=2)):
        assert len(set(f.token_ids)) >= len(set(b.token_ids))
    assert sum(len(set(c.token_ids)) for c in run(frequency_penalty=2)) > sum(
        len(set(c.token_ids)) for c in base
    )
    for b, lo in zip(base, run(presence_penalty=-2)):  # a negative presence penalty rewards repeats
        assert len(set(lo.token_ids)) < len(set(b.token_ids))
    forced = generate(
        llm_sync, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={42: 100})
    )
    assert all(c.token_ids == [42] * 4 for c in forced)
    only = generate(
        llm_sync, SamplingParams(temperature=1.0, seq_seed=5, max_tokens=N, allowed_token_ids=[7, 8])
    )
    assert all(set(c.token_ids) <= {7, 8} for c in only)


def test_defaults_and_no_op_processors_leave_outputs_bitwise_unchanged(llm_sync, micro_checkpoint):
    """Explicit neutral values (an empty bias, the whole vocabulary allowed) run the processor path
    and must not move a bit: tokens and logprobs equal the plain run, greedy and sampled."""
    vocab = llm_sync.engine.vocab_size
    for kw in (dict(temperature=0), dict(temperature=0.9, top_p=0.9, seq_seed=3)):
        plain = generate(llm_sync, SamplingParams(max_tokens=N, ignore_eos=True, logprobs=2, **kw))
        neutral = SamplingParams(
            max_tokens=N,
            ignore_eos=True,
            logprobs=2,
            logit_bias={5: 0.0},
            allowed_token_ids=list(range(vocab)),
            presence_penalty=0.0,
            frequency_penalty=0.0,
            repetition_penalty=1.0,
            **kw,
        )
        got = generate(llm_sync, neutral)
        for a, b in zip(plain, got):
            assert (
                a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
            )


def _mixed_params():
    return [
        SamplingParams(temperature=0.8, seq_seed=11, max_tokens=N, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(
            temperature=0, max_tokens=N, ignore_eos=True, frequency_penalty=0.7, logit_bias={3: 1.0}
        ),
        SamplingParams(
            temperature=1.0, seq_seed=12, max_tokens=N, ignore_eos=True, presence_penalty=1.2, top_k=20
        ),
    ]


def test_sync_and_async_loops_and_batch_mates_give_the_same_tokens(llm_sync, llm_async):
    params = _mixed_params()
    sync = [c.token_ids for c in generate(llm_sync, params)]
    asyn = [c.token_ids for c in generate(llm_async, params)]
    assert sync == asyn
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):  # alone, and beside unprocessed requests
        alone = generate(llm_async, [p], [prompt])[0].token_ids
        mates = [SamplingParams(temperature=0.7, seq_seed=99, max_tokens=3), p, SamplingParams(max_tokens=N)]
        crowd = generate(llm_sync, mates, [PROMPTS[(i + 1) % 3], prompt, PROMPTS[(i + 2) % 3]])[1].token_ids
        assert alone == crowd == sync[i]


def test_bad_words_are_never_generated(llm_sync):
    """A bad word of one token is never produced; one of two tokens never completed."""
    tok = llm_sync.engine.tokenizer  # the engine's own (tokenizers.Tokenizer)
    plain = generate(llm_sync, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
    # a generated token that reads back as itself, and a generated pair that does
    single = next(
        t
        for c in plain
        for t in c.token_ids
        if tok.encode(tok.decode([t]), add_special_tokens=False).ids == [t]
    )
    word = tok.decode([single])
    got = generate(llm_sync, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, bad_words=[word]))
    assert all(single not in c.token_ids for c in got)
    assert any(single in c.token_ids for c in plain)
    pairs = [
        (a, b)
        for c in plain
        for a, b in zip(c.token_ids, c.token_ids[1:])
        if tok.encode(tok.decode([a, b]).lstrip(), add_special_tokens=False).ids == [a, b]
    ]
    if not pairs:
        pytest.skip("no generated pair of tokens reads back as itself")
    a, b = pairs[0]
    p = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, bad_words=[tok.decode([a, b])])
    for c in generate(llm_sync, p):
        assert (a, b) not in set(zip(c.token_ids, c.token_ids[1:]))


def test_ids_outside_the_vocabulary_are_refused_at_the_door(llm_sync):
    for field, value in [("logit_bias", {512: 1.0}), ("allowed_token_ids", [600])]:
        with pytest.raises(ValueError, match=field):
            llm_sync.engine.add_request(
                "bad", None, SamplingParams(**{field: value}), prompt_token_ids=[0, 1]
            )
    assert not llm_sync.engine.has_unfinished_requests()


def test_processors_compose_with_structured_output(real_vocab_checkpoint):
    """The grammar mask and the processors both hold: a bias toward a token the grammar forbids
    changes nothing, a bias toward an allowed one wins, and a bad word beats the bias."""
    with LLM(model=str(real_vocab_checkpoint), block_size=16, max_model_len=64) as llm:
        tok = llm.engine.tokenizer
        (yes,) = tok.encode("yes", add_special_tokens=False).ids
        (hello,) = tok.encode("hello", add_special_tokens=False).ids
        so = {"schema_type": "regex", "schema": "(yes|no|maybe)!"}
        forced = SamplingParams(temperature=0, max_tokens=8, so_args=so, logit_bias={yes: 100, hello: 100})
        banned = SamplingParams(
            temperature=0, max_tokens=8, so_args=so, logit_bias={yes: 100}, bad_words=["yes"]
        )
        sampled = SamplingParams(
            n=3,
            temperature=1.0,
            seq_seed=4,
            max_tokens=8,
            so_args=so,
            logit_bias={hello: 100},
            repetition_penalty=2,
        )
        outs = llm.generate(["Answer:", "Answer:", "Answer:"], [forced, banned, sampled], use_tqdm=False)
        assert [o.error for o in outs] == [None] * 3
        assert outs[0].outputs[0].text == "yes!" and outs[0].outputs[0].token_ids[0] == yes
        b = outs[1].outputs[0]
        assert re.fullmatch("(yes|no|maybe)!", b.text) and yes not in b.token_ids
        for c in outs[2].outputs:
            assert re.fullmatch("(yes|no|maybe)!", c.text) and hello not in c.token_ids
