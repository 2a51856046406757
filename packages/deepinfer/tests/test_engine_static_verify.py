"""Speculative decoding through the graph-safe static step on the CPU: the engine's tokens
with drafting are identical whether decode / verification steps run the static step (the CUDA-graph
path without capture, `DecodeGraphSettings(capture=False)`) or the eager paged step, and whether the
drafts (greedy and sampled) run the static draft (`DecodeGraphSettings.draft`) or the eager one."""

import dataclasses

import pytest
import torch
from deepinfer import SamplingParams
from deepinfer.engine import llm_engine
from deepinfer.engine.drafting import Drafts, OracleDrafter
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_model.runtime.cuda_graphs import decode_graph_settings

PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42], [9, 9, 9, 9, 9, 1]]
NEXTN = 3


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-static-verify"), seed=0)


class PartlyWrongOracle:
    """The target's greedy continuation with one draft replaced by a wrong token at a position that
    varies with the sequence and step (or none): greedy verification then accepts 0 .. k drafts."""

    def __init__(self, model) -> None:
        self.oracle = OracleDrafter(model)
        self.calls = 0

    def propose(self, requests):
        out = []
        for req, d in zip(requests, self.oracle.propose(requests)):
            self.calls += 1
            wrong = (req.seq_id + self.calls) % (len(d.tokens) + 1)  # == len: all correct
            tokens = list(d.tokens)
            if wrong < len(tokens):
                tokens[wrong] = (tokens[wrong] + 1) % 256
            out.append(Drafts(tokens, d.confidences, d.probs))
        return out


def run(path, static: bool, monkeypatch, drafter=None, params=None, draft_graphs=True):
    """(tokens per prompt, decode graphs, acceptance summary, draft graphs). `params`: one for every
    prompt, or a list of one per prompt; `draft_graphs` (static runs): the drafts through the static
    draft too (`DecodeGraphSettings.draft`)."""
    if static:  # the engine's own settings for a CUDA device, run without capture on the CPU
        real = decode_graph_settings

        def settings(device, *args, **kw):
            return dataclasses.replace(real("cuda", *args, **kw), capture=False, draft=draft_graphs)

        monkeypatch.setattr(llm_engine, "decode_graph_settings", settings)
    else:
        monkeypatch.setattr(llm_engine, "decode_graph_settings", decode_graph_settings)
    # on the CPU whatever DEEPINFER_DEVICE says: the eager run must have no graphs, the static one no capture
    args = EngineArgs(model=str(path), block_size=16, max_model_len=64, max_num_seqs=4, device="cpu")
    engine = llm_engine.LLMEngine(args, num_speculative_tokens=NEXTN)
    if drafter is not None:
        engine.spec.drafter = drafter(engine.model)
    params = params or SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    per_prompt = params if isinstance(params, list) else [params] * len(PROMPTS)
    for j, prompt in enumerate(PROMPTS):
        engine.add_request(str(j), None, per_prompt[j], prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    graphs, drafts = engine.runner.graphs, engine.runner.draft_graphs
    accepted = dict(engine.spec.stats.summary())
    engine.close()
    return [outs[str(j)].outputs[0].token_ids for j in range(len(PROMPTS))], graphs, accepted, drafts


@pytest.mark.parametrize("drafter", [None, PartlyWrongOracle], ids=["paged-drafter", "partly-wrong-oracle"])
def test_engine_drafting_static_equals_eager(v41, drafter, monkeypatch):
    torch.set_num_threads(1)
    eager, g_eager, _, _ = run(v41, False, monkeypatch, drafter)
    static, g, stats, _ = run(v41, True, monkeypatch, drafter)
    assert g_eager is None and g is not None
    assert g.settings.max_batch_size == 4 * (1 + NEXTN) and g.settings.max_query_len == 1 + NEXTN
    assert g.verify_replays > 0  # verification steps went through the static step
    assert static == eager
    if drafter is PartlyWrongOracle:
        assert 0 < stats["accepted"] < stats["verified"], stats  # partial acceptance: rejected rows rewritten


def test_engine_sampled_drafting_static_equals_eager(v41, monkeypatch):
    torch.set_num_threads(1)
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, ignore_eos=True, seq_seed=5)
    eager, _, _, _ = run(v41, False, monkeypatch, params=p)
    static, g, _, drafts = run(v41, True, monkeypatch, params=p)
    assert g.verify_replays > 0 and drafts.sampled_replays > 0
    assert static == eager


def test_engine_sampled_drafts_static_draft_equals_eager_draft(v41, monkeypatch):
    """Decode / verification steps static in both runs; the drafts of a batch mixing greedy and sampled
    requests (temperatures, top-p / top-k / min-p, rejection-sampled and coupled verification) through
    the sampled draft graph's static path in one, eagerly (`DraftRowSampler`) in the other."""
    torch.set_num_threads(1)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, ignore_eos=True, seq_seed=5),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=8, min_p=0.05, max_tokens=10, ignore_eos=True, seq_seed=7),
        SamplingParams(temperature=0.6, max_tokens=10, ignore_eos=True, seq_seed=3),
    ]
    for verify in ("coupled", "rejection"):
        monkeypatch.setenv("DEEPINFER_SPEC_SAMPLED_VERIFY", verify)
        eager, _, _, no_drafts = run(v41, True, monkeypatch, params=params, draft_graphs=False)
        static, g, stats, drafts = run(v41, True, monkeypatch, params=params)
        assert no_drafts is None and drafts.sampled_replays > 0, verify
        assert g.verify_replays > 0 and stats["verified"] > 0
        assert static == eager, verify
