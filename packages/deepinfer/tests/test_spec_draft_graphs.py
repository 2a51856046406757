"""The paged drafter drafts a group of greedy requests with the greedy marker, so that a runner with
decode graphs replays its greedy draft graph (`runtime.draft_graphs`; uncaptured here, on the CPU),
and a sampled group without logits processors through the sampled draft graph; the drafts (tokens,
confidences, q) stay exactly the stateless `ModelDrafter`'s. Requests with logits processors keep the
eager sampled path."""

import numpy as np
import torch
from deepinfer.engine.drafting import DraftRequest, ModelDrafter, PagedDrafter
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.runtime.cuda_graphs import DecodeGraphSettings
from deepinfer_model.sampling import RowParams

BLOCK, K = 4, 3
PROMPTS = [[0, 17, 99, 4, 250, 61, 8, 130, 7, 9, 11], [5, 6, 7, 8], [100, 3, 42]]


def test_greedy_groups_replay_the_draft_graph(tmp_path):
    torch.set_num_threads(1)
    model = load_v41(make_v41_checkpoint(tmp_path, seed=2))
    settings = DecodeGraphSettings(4 * (1 + K), 64, 4, capture=False, max_query_len=1 + K)
    runner = PagedRunner(model, num_blocks=12, block_size=BLOCK, decode_graphs=settings)
    tables, nb = [], 0
    for p in PROMPTS:
        tables.append(np.arange(nb, nb + -(-len(p) // BLOCK), dtype=np.int32))
        nb += len(tables[-1])
    lens = np.array([len(p) for p in PROMPTS])
    runner.execute(
        StepBatch.of(
            seq_ids=np.array([10, 11, 12]),
            start_positions=np.zeros(3, dtype=np.int64),
            query_lens=lens,
            block_tables=tables,
            input_ids=np.concatenate(PROMPTS),
            logits_lens=np.ones(3, dtype=np.int64),
        )
    )
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
