"""Batch-invariant mode through the engine (`LLM`), with and without DSpark drafts: a request's tokens,
logprobs and top-5 logprobs are bitwise identical alone or mixed with other requests (other lengths,
chunked prefills under a small token budget, some sharing its prefix), whether or not its prefix came
from the prefix cache, in the sync and async loops, with a fixed seq_seed (engine.md §5.4, §5.7).

With drafts (DEEPINFER_USE_NEXTN_DECODE > 0) the target's tokens are verified in blocks whose sizes and
neighbours depend on the batch; the target logits of a verify row equal those of a decode row
(tests/test_repro_paged_batch_invariant.py), so greedy outputs with and without drafts agree too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer import SamplingParams

pytestmark = pytest.mark.usefixtures("deterministic_env")

RNG = np.random.default_rng(21)
PREFIX = RNG.integers(1000, 90_000, 32).tolist()  # two KV blocks: a prefix-cache hit reuses both
TARGET = PREFIX + RNG.integers(1000, 90_000, 6).tolist()
TOKENS = 8
# the engine on the CPU, and on CUDA where there is a GPU (`-m gpu`)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


def _params(temperature: float, seq_seed: int | None = 77, max_tokens: int = TOKENS) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        top_p=0.9,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=5,
        seq_seed=seq_seed,
    )


def _result(out):
    assert out.error is None, out.error
    c = out.outputs[0]
    assert len(c.token_ids) == TOKENS  # no vacuous agreement
    return (
        tuple(c.token_ids),
        tuple(c.token_logprobs),
        tuple(tuple(sorted(d.items())) for d in c.top_logprobs),
    )


def _fillers(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Other requests: short and long prompts (chunked prefills), one sharing the target's prefix,
    sampled with their own seeds and lengths (decode / verify rows of other sizes and contexts)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (3, 45, 17, 70):
        out.append((rng.integers(1000, 90_000, n).tolist(), _params(1.0, None, int(rng.integers(2, 12)))))
    out.append((PREFIX + rng.integers(1000, 90_000, 9).tolist(), _params(0.7, 5, 6)))
    return out


def _mixed(llm, params: SamplingParams, seed: int):
    items = [(TARGET, params), *_fillers(seed)]
    order = np.random.default_rng(seed).permutation(len(items))
    outs = llm.generate(
        prompt_token_ids=[items[i][0] for i in order],
        sampling_params=[items[i][1] for i in order],
        use_tqdm=False,
    )
    return _result(outs[int(np.flatnonzero(order == 0)[0])])


def _check(llm_factory, nextn: int, async_scheduling: bool, monkeypatch, device: str):
    """On one engine: the target alone at temperature 0 while nothing is cached, then alone at 0.9 and
    in a batch mix per temperature (its prefix cached by then). Returns the greedy result."""
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", str(nextn))
    llm = llm_factory(
        async_scheduling=async_scheduling, max_num_batched_tokens=24, max_num_seqs=6, device=device
    )
    assert llm.engine.num_speculative_tokens == nextn
    alone = {}
    for t in (0.0, 0.9):
        alone[t] = _result(
            llm.generate(prompt_token_ids=[TARGET], sampling_params=_params(t), use_tqdm=False)[0]
        )
    hits_before = llm.engine.scheduler_stats()["prefix_cache_hit_tokens"]
    mixed = {t: _mixed(llm, _params(t), seed) for seed, t in ((1, 0.0), (2, 0.9))}
    hits = llm.engine.scheduler_stats()["prefix_cache_hit_tokens"] - hits_before
    spec = llm.engine.spec_stats()
    llm.close()
    assert hits >= 2 * len(PREFIX)  # the target (and the prefix-sharing filler) hit the cache
    if nextn:
        assert spec["verified"] > 0 and spec["accepted"] > 0, spec  # drafts were verified and accepted
    for t in alone:
        assert mixed[t] == alone[t], (
            f"nextn {nextn}, async {async_scheduling}, temperature {t}: the mix differs"
        )
    assert alone[0.0] != alone[0.9]  # the sampled run is not greedy in disguise
    return alone[0.0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_outputs_are_batch_invariant_without_drafts(
    llm_factory, monkeypatch, async_scheduling, device
):
    _check(llm_factory, 0, async_scheduling, monkeypatch, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_outputs_are_batch_invariant_with_drafts(llm_factory, monkeypatch, async_scheduling, device):
    # rejection sampling: it accepts some of the random-weight drafter's drafts (coupled verification,
    # whose acceptance needs the draft to be the target's own draw, accepts none of them here: the
    # test below covers it)
    monkeypatch.setenv("DEEPINFER_SPEC_SAMPLED_VERIFY", "rejection")
    with_drafts = _check(llm_factory, 3, async_scheduling, monkeypatch, device)
    # greedy: drafts change how tokens are verified, not which, nor their logprobs (bitwise)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    llm = llm_factory(async_scheduling=async_scheduling, device=device)
    plain = _result(llm.generate(prompt_token_ids=[TARGET], sampling_params=_params(0.0), use_tqdm=False)[0])
    llm.close()
    assert with_drafts == plain


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_coupled_drafts_give_the_drafts_off_outputs_alone_and_mixed(
    llm_factory, monkeypatch, async_scheduling
):
    """Coupled verification (the default) with the draft policy on: the target's greedy and seeded sampled
    tokens, logprobs and top-5 logprobs, alone and in a batch mix, are bitwise those of drafts off."""
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    results = {}
    for nextn in (3, 0):
        monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", str(nextn))
        llm = llm_factory(async_scheduling=async_scheduling, max_num_batched_tokens=24, max_num_seqs=6)
        results[nextn] = {
            t: (
                _result(
                    llm.generate(prompt_token_ids=[TARGET], sampling_params=_params(t), use_tqdm=False)[0]
                ),
                _mixed(llm, _params(t), seed),
            )
            for t, seed in ((0.0, 1), (0.9, 2))
        }
        if nextn:
            assert llm.engine.spec.verifier.coupled and llm.engine.spec_stats()["verified"] > 0
        llm.close()
    assert results[3] == results[0]
    assert results[0][0.0] != results[0][0.9]
