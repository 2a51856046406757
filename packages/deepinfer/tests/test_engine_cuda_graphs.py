"""Engine greedy output with decode CUDA graphs equals DEEPINFER_ENFORCE_EAGER=1 (GPU only)."""

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


def test_device_fed_graph_steps_launch_without_waiting_for_the_device(tmp_path, monkeypatch):
    """The asynchronous loop launches a graphed decode step behind the one before it, its input ids read
    on the device from that step's sampled tokens (engine/step_pipeline.py): no launch waits for the
    device (torch's sync debug mode sees no synchronising call in `ModelWorker.launch`), the device-fed
    steps are taken, and the tokens are the synchronous loop's."""
    import warnings

    from deepinfer.engine import worker as worker_module

    path = make_v41_checkpoint(tmp_path / "v41", seed=3)
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "0")
    monkeypatch.setenv("DEEPINFER_ASYNC_DEVICE_INPUTS", "1")
    params = [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seq_seed=5, ignore_eos=True)]

    def generate(async_scheduling: bool, watch: list | None):
        args = EngineArgs(
            model=str(path), device="cuda", max_model_len=64, block_size=16, max_num_seqs=4,
            async_scheduling=async_scheduling,
        )  # fmt: skip
        engine = LLMEngine(args, num_speculative_tokens=0)
        if engine.pipeline is not None:  # (chain even where the tiny step is done before the next arrives)
            engine.pipeline.always_chain = True
        for j, prompt in enumerate(PROMPTS):
            engine.add_request(str(j), None, params[j % 2], prompt_token_ids=prompt)
        launch = worker_module.ModelWorker.launch

        def watched(self, *a, **k):
            if k.get("prev") is None:
                return launch(self, *a, **k)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = launch(self, *a, **k)
                watch.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))
                watch.append("launched")
                return out
            finally:
                torch.cuda.set_sync_debug_mode("default")

        if watch is not None:
            monkeypatch.setattr(worker_module.ModelWorker, "launch", watched)
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = o
        monkeypatch.setattr(worker_module.ModelWorker, "launch", launch)
        fed, replays = engine.worker.device_fed_steps, engine.runner.graphs.replays
        engine.close()
        return [outs[str(j)].outputs[0].token_ids for j in range(len(PROMPTS))], fed, replays

    seen: list = []
    chained, fed, replays = generate(True, seen)
    sync, _, _ = generate(False, None)
    assert chained == sync
    assert fed >= 8 and replays > 0 and seen.count("launched") >= 8
    assert [m for m in seen if m != "launched"] == []
