"""vLLM's logits processors with DSpark drafts on the random-weight tiny V4.1: the verifier's row j sees
drafts 1..j as output tokens, so greedy outputs with drafts equal those without, whichever drafter
proposes them, and sampled outputs stay seeded and batch independent."""

import pytest
from deepinfer import SamplingParams
from deepinfer.engine.drafting import Drafts, ModelDrafter
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42]]
N = 12

GREEDY = [
    SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, repetition_penalty=3.0),
    SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, frequency_penalty=2.0, logit_bias={7: 1.5}),
    SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, presence_penalty=-2.0, bad_words=["a"]),
]


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-spec-processors"), seed=0)


def run(path, params, nextn=0, drafter=None, prompts=PROMPTS):
    engine = LLMEngine(
        EngineArgs(model=str(path), block_size=16, max_model_len=48), num_speculative_tokens=nextn
    )
    if drafter is not None:
        engine.spec.drafter = drafter(engine.model)
    for j, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(j), None, p, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.error is None, o.error
            outs[o.request_id] = o
    engine.close()
    return [outs[str(j)].outputs[0].token_ids for j in range(len(prompts))], engine


class ReplayDrafter:
    """Proposes the continuation a reference run produced: every draft is accepted when the verifier
    processes row j with drafts 1..j as output, as plain decoding did."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference = reference

    def propose(self, requests):
        out = []
        for req in requests:
            seen = [*req.context, req.next_token]
            prompt = next(p for p in self.reference if tuple(seen[: len(p)]) == p)
            done = len(seen) - len(prompt)
            tokens = (self.reference[prompt][done : done + req.num_drafts] + [0] * req.num_drafts)[
                : req.num_drafts
            ]
            out.append(Drafts(tokens, [1.0] * len(tokens)))
        return out


@pytest.fixture(scope="module")
def plain(v41):
    tokens, _ = run(v41, GREEDY)
    return tokens


def test_greedy_with_processors_and_drafts_equals_drafts_off(v41, plain):
    for nextn, drafter in [(3, None), (2, ModelDrafter)]:
        got, engine = run(v41, GREEDY, nextn=nextn, drafter=drafter)
        assert got == plain, (nextn, drafter)
        assert engine.spec_stats()["verified"] > 0


def test_drafts_that_follow_the_processed_continuation_are_all_accepted(v41, plain):
    reference = {tuple(p): t for p, t in zip(PROMPTS, plain)}
    got, engine = run(v41, GREEDY, nextn=4, drafter=lambda model: ReplayDrafter(reference))
    assert got == plain
    s = engine.spec_stats()
    assert s["verified"] > 0 and s["accepted"] == s["verified"]  # rows j > 0 saw drafts 1..j


def test_sampled_with_processors_and_drafts_is_seeded_and_batch_independent(v41):
    params = [
        SamplingParams(temperature=0.9, seq_seed=21, max_tokens=N, ignore_eos=True, repetition_penalty=2.0),
        SamplingParams(temperature=1.0, seq_seed=22, max_tokens=N, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(temperature=0.8, seq_seed=23, max_tokens=N, ignore_eos=True),
    ]
    together, _ = run(v41, params, nextn=3)
    again, _ = run(v41, params, nextn=3)
    assert together == again
    alone, _ = run(v41, params[:1], nextn=3, prompts=PROMPTS[:1])
    assert alone[0] == together[0]
    for toks in together[:1]:  # the strong repetition penalty keeps the sampled output varied
        assert len(set(toks)) > N // 2
