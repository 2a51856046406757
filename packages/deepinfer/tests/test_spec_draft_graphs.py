"""The paged drafter drafts a group of greedy requests with the greedy marker, so that a runner with
decode graphs replays its greedy draft graph (`runtime.draft_graphs`; uncaptured here, on the CPU),
and a sampled group without logits processors through the sampled draft graph; the drafts (tokens,
confidences, q) stay exactly the stateless `ModelDrafter`'s. Requests with logits processors keep the
eager sampled path."""

import numpy as np
import torch
from deepinfer.engine.drafting import DraftRequest, DraftRowSampler, ModelDrafter, PagedDrafter
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.runtime.cuda_graphs import DecodeGraphSettings
from deepinfer_model.sampling import RowParams

BLOCK, K = 4, 3
PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130, 7, 9, 11], [5, 6, 7, 8], [100, 3, 42]]


def prefilled_runner(tmp_path, seed: int):
    """A random-weight V4.1 and its paged runner (uncaptured static graphs, draft count K) after the
    prefill of PROMPTS as sequences 10, 11, 12."""
    model = load_v41(make_v41_checkpoint(tmp_path, seed=seed))
    settings = DecodeGraphSettings(4 * (1 + K), 64, 4, capture=False, max_query_len=1 + K)
    runner = PagedRunner(model, num_blocks=12, block_size=BLOCK, decode_graphs=settings)
    tables, nb = [], 0
    for p in PROMPTS:
        tables.append(np.arange(nb, nb + -(-len(p) // BLOCK), dtype=np.int32))
        nb += len(tables[-1])
    runner.execute(
        StepBatch.of(
            seq_ids=np.array([10, 11, 12]),
            start_positions=np.zeros(3, dtype=np.int64),
            query_lens=np.array([len(p) for p in PROMPTS]),
            block_tables=tables,
            input_ids=np.concatenate(PROMPTS),
            logits_lens=np.ones(3, dtype=np.int64),
        )
    )
    return model, runner


def test_greedy_groups_replay_the_draft_graph(tmp_path):
    torch.set_num_threads(1)
    model, runner = prefilled_runner(tmp_path, seed=2)
    paged, stateless = PagedDrafter(runner, model), ModelDrafter(model)

    def requests(temperature, k=K, **kw):
        return [
            DraftRequest(
                10 + i, p[:-1], p[-1], k, RowParams(temperature=temperature, seed=i, **kw), len(p), 0
            )
            for i, p in enumerate(PROMPTS)
        ]

    g = runner.draft_graphs
    for temperature, k, kw, replays, sampled in (
        (0.0, K, {}, 1, 0),
        (0.8, K, {}, 2, 1),  # sampled, no processors: the sampled static path
        (0.0, K - 1, {}, 2, 1),  # another draft count: eager
        (0.8, K, dict(presence_penalty=0.5), 2, 1),  # logits processors: eager
        (0.8, K, dict(top_k=5, min_p=0.05), 3, 2),
    ):
        reqs = requests(temperature, k, **kw)
        got, want = paged.propose(reqs), stateless.propose(reqs)
        assert (g.replays, g.sampled_replays) == (replays, sampled), (temperature, k, kw)
        for a, b in zip(got, want):
            assert a.tokens == b.tokens and a.confidences == b.confidences
            assert (a.probs is None) == (temperature == 0) == (b.probs is None)
            if a.probs is not None:
                assert torch.equal(a.probs, b.probs)


MIXED = [  # one row per prompt: greedy, nucleus + min-p, top-k at a high temperature
    RowParams(temperature=0.0),
    RowParams(temperature=0.7, top_p=0.8, min_p=0.02, seed=9),
    RowParams(temperature=1.6, top_k=7, seed=2**64 - 1),
]


def test_sampled_group_static_draft_equals_the_eager_row_sampler(tmp_path):
    """The batched eager draft with `DraftRowSampler` (tokens_only False: eager) against the same group
    through the static path, bitwise (tokens, confidences, q), mixed greedy / sampled rows in a padded
    bucket (3 sequences, bucket 4), several stream positions and both verification seeds; then the
    paged drafter's proposals against the stateless drafter's."""
    torch.set_num_threads(1)
    model, runner = prefilled_runner(tmp_path, seed=3)
    g = runner.draft_graphs
    for trial, (params, draft_seed) in enumerate(
        [(MIXED, None), (MIXED[::-1], 77), ([MIXED[1], MIXED[2], MIXED[1]], None)]
    ):
        reqs = [
            DraftRequest(10 + i, p[:-1], p[-1], K, params[i], 40 * trial + 3 * i, i % 2, draft_seed)
            for i, p in enumerate(PROMPTS)
        ]
        kw = dict(seq_indices=[0, 1, 2], last_positions=[len(r.context) - 1 for r in reqs])
        eager_sampler, static_sampler = (
            DraftRowSampler(reqs, torch.device("cpu")),
            DraftRowSampler(reqs, torch.device("cpu")),
        )
        before = g.sampled_replays
        eager = runner.draft([r.next_token for r in reqs], K, sampler=eager_sampler, **kw)
        static = runner.draft([r.next_token for r in reqs], K, sampler=static_sampler, tokens_only=True, **kw)
        assert g.sampled_replays == before + 1 and static_sampler.q is None
        for e, s, q, p in zip(eager, static, eager_sampler.probs(), params):
            assert torch.equal(e.tokens, s.tokens) and torch.equal(e.confidence, s.confidence), trial
            assert (q is None) == p.greedy == (s.probs is None)
            if q is not None:
                assert torch.equal(q, s.probs), trial
        got, want = PagedDrafter(runner, model).propose(reqs), ModelDrafter(model).propose(reqs)
        for a, b in zip(got, want):
            assert a.tokens == b.tokens and a.confidences == b.confidences
            assert (a.probs is None) == (b.probs is None)
            if a.probs is not None:
                assert torch.equal(a.probs, b.probs)
