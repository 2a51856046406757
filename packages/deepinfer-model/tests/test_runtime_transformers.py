"""deepseek_v4 through the paged runner against transformers' own incremental decode (its cache, one
token at a time after a prefill), FP32: 1e-5 relative. The decode crosses window and compression
boundaries of every attention kind (SWA window 8, CSA ratio 4 with overlap, HCA ratio 8)."""

import numpy as np
import pytest
import torch
from deepinfer_model import load_model
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.testing import make_checkpoint, tiny_config

transformers = pytest.importorskip("transformers")
RTOL = 1e-5


def _step(runner, start, tokens, table):
    return runner.execute(
        StepBatch.of(
            seq_ids=np.array([0]),
            start_positions=np.array([start]),
            query_lens=np.array([len(tokens)]),
            block_tables=[table],
            input_ids=np.asarray(tokens, dtype=np.int64),
            logits_lens=np.array([1]),
        )
    )[0]


def test_v4_decode_matches_transformers_incremental_decode(tmp_path):
    path = make_checkpoint(tmp_path, tiny_config(), seed=3, tokenizer=False)
    transformers.logging.set_verbosity_error()
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    toks = torch.tensor(np.random.default_rng(1).integers(0, 128, 30))
    prompt = 11
    hf_rows = []
    with torch.no_grad():
        out = hf(toks[None, :prompt], use_cache=True)
        hf_rows.append(out.logits[0, -1])
        for t in range(prompt, len(toks)):
            out = hf(toks[None, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            hf_rows.append(out.logits[0, -1])
    ref = torch.stack(hf_rows)

    runner = PagedRunner(load_model(path), num_blocks=6, block_size=8)
    table = np.array([5, 0, 3, 1], dtype=np.int32)
    rows = [_step(runner, 0, toks[:prompt].numpy(), table)]
    rows += [_step(runner, t, toks[t : t + 1].numpy(), table) for t in range(prompt, len(toks))]
    ours = torch.stack(rows)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < RTOL, f"max relative deviation from transformers' decode {err:.2e} >= {RTOL}"
