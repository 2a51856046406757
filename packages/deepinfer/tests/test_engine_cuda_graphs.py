"""Engine greedy output with decode CUDA graphs equals DEEPINFER_ENFORCE_EAGER=1 (issue #13; GPU only)."""

import pytest
import torch
from deepinfer import EngineArgs, LLMEngine, SamplingParams
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PROMPTS = [[0, 40, 77, 91, 12, 30, 5], [0, 7, 7, 8, 9], [0, 45, 33, 98, 140, 21, 66, 71, 250], [3, 4]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(path, eager: bool, monkeypatch, nextn=0):
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1" if eager else "0")
    args = EngineArgs(model=str(path), device="cuda", max_model_len=64, block_size=16, max_num_seqs=4)
    engine = LLMEngine(args, num_speculative_tokens=nextn)
    for j, prompt in enumerate(PROMPTS):
        engine.add_request(str(j), None, GREEDY, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    graphs = engine.runner.graphs
    replays = 0 if graphs is None else graphs.replays
    engine.close()
    return [outs[str(j)].outputs[0].token_ids for j in range(len(PROMPTS))], graphs, replays


def test_engine_greedy_with_graphs_equals_eager(tmp_path, monkeypatch):
    path = make_v41_checkpoint(tmp_path / "v41", seed=3)
    eager, g_eager, _ = run(path, True, monkeypatch)
    graphed, g, replays = run(path, False, monkeypatch)
    assert g_eager is None and g is not None
    assert replays > 0  # decode steps went through the graphs
    assert graphed == eager


def test_engine_greedy_drafting_with_graphs_equals_eager(tmp_path, monkeypatch):
    """Drafting on (nextn 3): verification steps replay graphs of up to 4 x (1 + 3) tokens."""
    path = make_v41_checkpoint(tmp_path / "v41", seed=3)
    eager, _, _ = run(path, True, monkeypatch, nextn=3)
    graphed, g, replays = run(path, False, monkeypatch, nextn=3)
    assert g is not None and g.verify_replays > 0
    assert graphed == eager
