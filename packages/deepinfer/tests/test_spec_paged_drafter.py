"""The paged drafter (drafts read from the paged runner's cached drafter keys, no extra forward) must
propose exactly what the stateless `ModelDrafter` proposes, also after verification steps that
rejected drafts (their rows are in the cache but must never be read). Bitwise where the model computes
with the reference ops (the CPU, or CUDA with DEEPINFER_ACCELERATOR=cpu); with the NVIDIA ops (TileLang
kernels, cuBLAS projections whose kernel follows the token count) the same tokens and confidences within
FP32 rounding (seen on an H200: one ulp)."""

import pytest
import torch
from deepinfer import SamplingParams
from deepinfer.engine.drafting import ModelDrafter, PagedDrafter
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from deepinfer_model.ops import get_ops

PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130], [5, 6, 7, 8], [100, 3, 42]]


class CrossCheck:
    """Proposes the paged drafts after checking them against the stateless drafter's."""

    def __init__(self, engine):
        self.paged = PagedDrafter(engine.runner, engine.model)
        self.stateless = ModelDrafter(engine.model)
        self.bitwise = torch.device(engine.device).type == "cpu" or get_ops().backend == "cpu"
        self.checked = 0
        self.after_rejection = 0

    def propose(self, requests):
        got = self.paged.propose(requests)
        want = self.stateless.propose(requests)
        for req, g, w in zip(requests, got, want):
            assert g.tokens == w.tokens, req.seq_id
            assert (g.probs is None) == (w.probs is None)
            if self.bitwise:
                assert g.confidences == w.confidences, req.seq_id
                if g.probs is not None:
                    assert torch.equal(g.probs, w.probs)
            else:
                assert g.confidences == pytest.approx(w.confidences, rel=1e-5, abs=1e-7), req.seq_id
                if g.probs is not None:
                    torch.testing.assert_close(g.probs, w.probs, rtol=1e-5, atol=1e-7)
            self.checked += 1
            # a verification step whose drafts were not all accepted left rejected rows in the cache
            self.after_rejection += req.num_accepted < 3
        return got


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-paged-drafter"), seed=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seq_seed=11),
    ],
)
def test_paged_drafts_equal_stateless_drafts(v41, params):
    torch.set_num_threads(1)
    engine = LLMEngine(EngineArgs(model=str(v41), block_size=16, max_model_len=48), num_speculative_tokens=3)
    assert isinstance(engine.spec.drafter, PagedDrafter)  # the default with the paged runner
    check = engine.spec.drafter = CrossCheck(engine)
    for j, prompt in enumerate(PROMPTS):
        engine.add_request(str(j), None, params, prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    assert check.checked > 0 and check.after_rejection > 0
