"""Logprobs as vLLM returns them: per position {token id: Logprob(logprob, rank, decoded_token)}, the
chosen token plus the top alternatives, and `cumulative_logprob`; checked against a float64
log_softmax of the model's logits from a direct forward."""

import pytest
import torch
from deepinfer import LLM, Logprob, SamplingParams

PROMPT = [0, 40, 77, 91, 12, 300, 5]


@pytest.fixture(scope="module")
def llm(micro_checkpoint):
    with LLM(model=str(micro_checkpoint), block_size=16, max_model_len=128) as llm:
        yield llm


def _reference(model, ids):
    """float64 log-probabilities of the next token after `ids`, from the stateless forward."""
    return torch.log_softmax(model.forward(torch.tensor(ids))[-1].double(), -1)


@pytest.mark.parametrize("k", [0, 3])
def test_logprob_objects_match_a_float64_reference(llm, k):
    params = SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True, seq_seed=3, logprobs=k)
    c = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert len(c.logprobs) == len(c.token_ids) == 5 and c.num_logprobs == k
    ids, total, expected_top = list(PROMPT), 0.0, []
    for token, entry in zip(c.token_ids, c.logprobs):
        ref = _reference(llm.engine.model, ids)
        order = torch.argsort(ref, descending=True, stable=True).tolist()
        assert next(iter(entry)) == token  # the chosen token first, as vLLM lists it
        top = order[:k]
        assert set(entry) == {token, *top}
        for t, lp in entry.items():
            assert isinstance(lp, Logprob)
            assert lp.logprob == pytest.approx(float(ref[t]), abs=1e-5)
            assert lp.decoded_token == tok.decode([t], skip_special_tokens=False)
        for place, t in enumerate(top, start=1):
            assert entry[t].rank == place
        if token not in top:
            assert entry[token].rank == max(int((ref > ref[token]).sum()) + 1, k + 1)
        expected_top.append([(t, entry[t].logprob) for t in top])
        total += float(ref[token])
        ids.append(token)
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert c.cumulative_logprob == pytest.approx(sum(c.token_logprobs), abs=1e-9)
    # the older per-position views stay readable
    assert c.token_logprobs == [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
    assert [list(d.items()) for d in c.top_logprobs] == expected_top


def test_greedy_chosen_token_is_rank_one_and_no_logprobs_when_not_asked(llm):
    c = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[
        0
    ].outputs[0]
    assert all(d[t].rank == 1 and len(d) == 2 for t, d in zip(c.token_ids, c.logprobs))
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None and plain.token_logprobs is None


def test_logprobs_in_the_json_record(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, logprobs=1), use_tqdm=False)[0]
    record = out.to_json()["outputs"][0]
    first = record["logprobs"][0]
    token = str(out.outputs[0].token_ids[0])
    assert set(first) == {token} and set(first[token]) == {"logprob", "rank", "decoded_token"}
    assert record["cumulative_logprob"] == out.outputs[0].cumulative_logprob


def test_the_cli_shows_each_tokens_logprob_rank_and_alternatives_in_rank_order(llm):
    """`deepinfer generate`'s lines for a completion with logprobs (cli/display.py) read the `Logprob`
    objects: the chosen token's text, logprob and rank, then the alternatives most likely first."""
    from deepinfer.cli.display import logprob_lines

    params = SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True, seq_seed=5, logprobs=2)
    c = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    lines = logprob_lines(c, decode=lambda t: f"<{t}>")
    assert len(lines) == 4
    for line, token, entry, top in zip(lines, c.token_ids, c.logprobs, c.top_logprobs):
        chosen = entry[token]
        head = f"  {chosen.decoded_token!r} {chosen.logprob:.4f} (rank {chosen.rank})"
        alts = ", ".join(f"{entry[t].decoded_token!r} {v:.4f}" for t, v in top.items())
        assert line == f"{head}  top: {alts}"
        assert [entry[t].rank for t in top] == [1, 2]
