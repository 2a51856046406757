"""Seeded sampled outputs do not depend on whether a step verifies drafts (coupled verification, the
default), on the random-weight §11 tiny V4.1 with batch invariance on (verify rows then carry the bits of
decode rows).

Seeded requests at temperature 0.8 (plain, top-p, top-k with a presence penalty, n = 2) run (a) with
drafts off, (b) with every draft verified (DEEPINFER_ENABLE_MTP_VARLEN=0) from the model's own drafter
(almost always wrong: correction tokens), from drafts that are the (a) tokens (all accepted) and from
drafts that are partly wrong, and (c) with the draft policy on and a drafter right for one request and
wrong for the others, so that the policy drafts for some sequence-steps and not for others: every run
emits the tokens and logprobs of (a). Rejection sampling (DEEPINFER_SPEC_SAMPLED_VERIFY=rejection) does
not: same distribution, other tokens.
"""

import pytest
import torch
from deepinfer import SamplingParams
from deepinfer.engine.drafting import Drafts
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_spec import StepTimeCurve

PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42], [9, 9, 200, 31, 77]]
COMMON = dict(max_tokens=20, ignore_eos=True)
PARAMS = [
    SamplingParams(temperature=0.8, seq_seed=3, logprobs=2, **COMMON),
    SamplingParams(temperature=0.8, top_p=0.9, seq_seed=4, logprobs=1, **COMMON),
    SamplingParams(temperature=0.8, top_k=8, presence_penalty=0.5, seq_seed=5, logprobs=0, **COMMON),
    SamplingParams(temperature=0.8, min_p=0.02, n=2, seq_seed=6, logprobs=1, **COMMON),
]
NEXTN = 3


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-seeded"), seed=0)


@pytest.fixture(autouse=True)
def batch_invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def run(path, nextn=0, drafter=None, curve=None):
    """Per request, per sample: (tokens, logprobs, top logprobs); and the engine."""
    args = EngineArgs(model=str(path), block_size=16, max_model_len=48)
    engine = LLMEngine(args, num_speculative_tokens=nextn, step_time_curve=curve)
    if drafter is not None:
        engine.spec.drafter = drafter(engine)
    for j, (prompt, p) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(str(j), None, p, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    engine.close()
    got = []
    for j in range(len(PROMPTS)):
        assert outs[str(j)].error is None, outs[str(j)].error
        got.append([(c.token_ids, c.token_logprobs, c.top_logprobs) for c in outs[str(j)].outputs])
    return got, engine


@pytest.fixture(scope="module")
def drafts_off(v41):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("DEEPINFER_BATCH_INVARIANT", "1")
        got, _ = run(v41)
    assert all(len(toks) == COMMON["max_tokens"] for req in got for toks, _, _ in req)
    return got


class ContinuationDrafter:
    """Drafts read from the drafts-off continuations (one-hot q, confidence 0.9): right, except for the
    requests in `wrong` (every draft shifted by one id) and the positions `wrong_at(position)` says."""

    def __init__(self, engine, drafts_off, wrong=(), wrong_at=lambda position: False) -> None:
        self.full = [
            (j, list(PROMPTS[j]) + list(toks)) for j, req in enumerate(drafts_off) for toks, _, _ in req
        ]
        self.vocab, self.wrong, self.wrong_at = engine.vocab_size, set(wrong), wrong_at

    def propose(self, requests):
        out = []
        for req in requests:
            seen = [*req.context, req.next_token]
            # (a sequence that left the drafts-off continuations gets drafts from an unrelated one)
            j, full = next(((j, f) for j, f in self.full if f[: len(seen)] == seen), (None, [0] * 48))
            tokens = full[len(seen) : len(seen) + req.num_drafts]
            tokens += [0] * (req.num_drafts - len(tokens))
            tokens = [
                (t + 1) % self.vocab if j in self.wrong or self.wrong_at(len(seen) + i) else t
                for i, t in enumerate(tokens)
            ]
            q = torch.zeros(len(tokens), self.vocab, dtype=torch.float64)
            q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
            out.append(Drafts(tokens, [0.9] * len(tokens), q))
        return out


def test_every_draft_verified_emits_the_drafts_off_tokens_and_logprobs(v41, drafts_off, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    drafters = {
        "model": None,
        "right": lambda e: ContinuationDrafter(e, drafts_off),
        "partly wrong": lambda e: ContinuationDrafter(e, drafts_off, wrong_at=lambda pos: pos % 3 == 1),
    }
    for name, drafter in drafters.items():
        got, engine = run(v41, NEXTN, drafter)
        s = engine.spec_stats()
        assert got == drafts_off, name
        assert s["verified"] > 0, name
        if name == "right":
            assert s["accepted"] == s["verified"]
        if name == "partly wrong":
            assert 0 < s["accepted"] < s["verified"]


def test_the_draft_policy_mixing_drafted_and_plain_steps_emits_the_drafts_off_tokens(
    v41, drafts_off, monkeypatch, tmp_path
):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    curve = tmp_path / "curve.json"  # 20 ms a decode step, 0.3 ms more per verified token
    StepTimeCurve([1, 64], [20.0, 20.0 + 0.3 * 63], mode="linear", extrapolate=True).save(curve)
    got, engine = run(v41, NEXTN, lambda e: ContinuationDrafter(e, drafts_off, wrong={1, 2, 3}), curve)
    s = engine.spec_stats()
    # the policy drafted for some sequence-steps (request 0's drafts accepted) and not for others
    assert s["policy_drafted_seq_steps"] > 0 and s["policy_skipped_seq_steps"] > 0
    assert 0 < s["accepted"] < s["verified"]
    assert got == drafts_off


def test_rejection_sampling_is_kept_under_its_setting_and_gives_other_tokens(v41, drafts_off, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    monkeypatch.setenv("DEEPINFER_SPEC_SAMPLED_VERIFY", "rejection")
    got, engine = run(v41, NEXTN)
    assert engine.spec.verifier.sampling == "rejection" and engine.spec_stats()["verified"] > 0
    assert [[t for t, _, _ in req] for req in got] != [[t for t, _, _ in req] for req in drafts_off]
