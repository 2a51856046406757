"""Deterministic sampling end to end (engine.md §5.4): with batch invariance, varlen off and a fixed
seq_seed, identical inputs give identical outputs across runs, batch compositions, the sync and async
loops and engine restarts; and the determinism study, scaled for CI (the full 1,000 requests:
benchmarks/repro/bench_determinism.py)."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer import SamplingParams

pytestmark = pytest.mark.usefixtures("deterministic_env")

PROMPT = np.random.default_rng(3).integers(1000, 90_000, 13).tolist()


def _fillers(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 90_000, int(rng.integers(2, 40))).tolist() for _ in range(count)]


def _params(temperature: float, seq_seed: int | None = 1234, max_tokens: int = 5) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        top_p=0.95,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=0,
        seq_seed=seq_seed,
    )


def _completion(out):
    assert out.error is None, out.error
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(c.token_logprobs)


def _generate_mixed(llm, copies: int, fillers: list[list[int]], params: SamplingParams, rng) -> list:
    """`copies` target requests and the fillers in a random order, all in one generate call."""
    items = [(PROMPT, params)] * copies + [
        (f, _params(1.0, seq_seed=None, max_tokens=int(rng.integers(1, 8)))) for f in fillers
    ]
    order = rng.permutation(len(items))
    outs = llm.generate(
        prompt_token_ids=[items[i][0] for i in order],
        sampling_params=[items[i][1] for i in order],
        use_tqdm=False,
    )
    targets = [_completion(outs[k]) for k, i in enumerate(order) if i < copies]
    assert all(len(tokens) == params.max_tokens for tokens, _ in targets)  # no vacuous (empty) agreement
    return targets


@pytest.fixture(scope="module")
def sync_llm(llm_factory):
    llm = llm_factory(async_scheduling=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def async_llm(llm_factory):
    # small token budget: prompts are chunked and share steps with other requests
    llm = llm_factory(async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=12)
    yield llm
    llm.close()


def test_identical_across_batches_loops_and_restarts(sync_llm, async_llm, llm_factory):
    rng = np.random.default_rng(0)
    for temperature in (0.0, 0.9):
        params = _params(temperature)
        results = {}
        results["sync alone"] = _completion(
            sync_llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
        )
        results["sync batch"] = _generate_mixed(sync_llm, 1, _fillers(1, 4), params, rng)[0]
        results["async batch"] = _generate_mixed(async_llm, 1, _fillers(2, 3), params, rng)[0]
        results["rerun"] = _completion(
            sync_llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
        )
        assert len(set(results.values())) == 1, (temperature, results)
        assert len(results["sync alone"][0]) == 5
    # an engine restart: a fresh LLM, nothing shared with the ones above
    fresh = llm_factory(async_scheduling=True)
    restarted = _completion(
        fresh.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    )
    fresh.close()
    assert restarted == results["sync alone"]


def test_determinism_study_scaled(async_llm):
    """24 identical requests at temperature 0, and 24 at temperature 0.9 with one seq_seed, mixed into
    batches of varying size and order, give exactly one distinct completion each; with 8 different
    seeds at temperature 0.9 they do not (the check can fail)."""
    llm = async_llm
    rng = np.random.default_rng(11)
    for temperature in (0.0, 0.9):
        completions = []
        for round_, copies in enumerate((2, 10, 12)):  # 24 in all, in three batch mixes
            fillers = _fillers(100 + round_, int(rng.integers(1, 3)))
            completions += _generate_mixed(llm, copies, fillers, _params(temperature, max_tokens=3), rng)
        assert len(completions) == 24
        assert len(set(completions)) == 1, f"temperature {temperature}: {len(set(completions))} distinct"
    seeded = llm.generate(
        prompt_token_ids=[PROMPT] * 8,
        sampling_params=[_params(0.9, seq_seed=s, max_tokens=3) for s in range(8)],
        use_tqdm=False,
    )
    assert len({_completion(o)[0] for o in seeded}) > 1
