"""The batched draft sampler (`DraftRowSampler`: draft s of every row in one pass) against a per-row,
per-position reference written from the definitions: greedy rows take the argmax, sampled rows draw
by inverse CDF from `filtered_probs` of their own row with the uniform of their draft stream
(`stream_uniform(seed + DRAFT_SEED_OFFSET, draft_position(base, accepted, s))`). Bitwise, over batch
mixes and seeds; plus the draws' frequencies against the exact filtered distribution (chi-square)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepinfer.engine.drafting import DraftRequest, DraftRowSampler
from deepinfer_model import RowParams, filtered_probs
from deepinfer_spec import DRAFT_SEED_OFFSET, Purpose, draft_position, inverse_cdf, stream_uniform
from torch.overrides import TorchFunctionMode

VOCAB = 97


def _request(i: int, params: RowParams, k: int, base: int, accepted: int) -> DraftRequest:
    return DraftRequest(i, [1, 2, 3], 4, k, params, base, accepted)


def _reference(requests, logits_per_step):
    """Per row and per draft step, one row at a time: (tokens [N, k], q per row or None)."""
    n, k = len(requests), len(logits_per_step)
    tokens = torch.empty(n, k, dtype=torch.long)
    probs = [[] for _ in range(n)]
    for s, logits in enumerate(logits_per_step):
        for r, req in enumerate(requests):
            p = req.params
            if p.greedy:
                tokens[r, s] = torch.argmax(logits[r])
                continue
            q = filtered_probs(logits[r][None].float(), [p])[0].double()
            u = stream_uniform(
                p.seed + DRAFT_SEED_OFFSET,
                draft_position(req.base_position, req.num_accepted, s),
                Purpose.SAMPLE,
            )
            tokens[r, s] = inverse_cdf(q[None], torch.tensor([u], dtype=torch.float64))[0]
            probs[r].append(q)
    return tokens, [torch.stack(q) if q else None for q in probs]


MIXES = {
    "greedy": [RowParams(temperature=0.0)] * 3,
    "nucleus": [RowParams(temperature=0.8, top_p=0.9, seed=s) for s in (1, 2, 3, 4)],
    "mixed": [
        RowParams(temperature=0.0),
        RowParams(temperature=1.0, top_k=5, seed=7),
        RowParams(temperature=0.6, min_p=0.1, seed=2**64 - 3),
        RowParams(temperature=0.0),
        RowParams(temperature=1.3, top_p=0.5, top_k=20, seed=123456789),
    ],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("seed", [0, 1, 99])
def test_batched_draws_equal_per_row_draws(mix, seed):
    gen = torch.Generator().manual_seed(seed)
    k = 4
    requests = [
        _request(i, p, k, base=int(torch.randint(0, 500, (1,), generator=gen)), accepted=i % 3)
        for i, p in enumerate(MIXES[mix])
    ]
    steps = [torch.randn(len(requests), VOCAB, generator=gen, dtype=torch.float64) * 3 for _ in range(k)]
    sampler = DraftRowSampler(requests, torch.device("cpu"))
    got = torch.stack([sampler.pick_rows(logits, s) for s, logits in enumerate(steps)], dim=1)
    want, want_q = _reference(requests, steps)
    assert torch.equal(got, want)
    for q, w in zip(sampler.probs(), want_q):
        assert (q is None) == (w is None)
        if q is not None:
            assert torch.equal(q, w)


def test_a_row_draws_the_same_whatever_shares_its_batch():
    gen = torch.Generator().manual_seed(5)
    p = RowParams(temperature=0.9, top_p=0.95, seed=42)
    alone = [_request(0, p, 3, 17, 1)]
    crowd = [_request(1, RowParams(temperature=0.0), 3, 3, 0), alone[0], _request(2, p, 3, 99, 2)]
    logits = [torch.randn(3, VOCAB, generator=gen) for _ in range(3)]
    a = DraftRowSampler(alone, torch.device("cpu"))
    c = DraftRowSampler(crowd, torch.device("cpu"))
    for s, row in enumerate(logits):
        assert a.pick_rows(row[1:2], s)[0] == c.pick_rows(row, s)[1]


def _chi2_critical(dof: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square upper quantile (z: p = 1e-4)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def test_draws_follow_the_filtered_distribution():
    """Many rows with the same logits and distinct seeds: the frequencies of every draft step fit the
    exact float64 filtered distribution (softmax at the temperature, nucleus cut; Pearson chi-square,
    p = 1e-4)."""
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(1, 12, generator=gen, dtype=torch.float64)
    temperature, top_p, n = 0.7, 0.9, 20000
    exact = torch.softmax(row[0] / temperature, dim=-1)
    order = torch.argsort(exact, descending=True, stable=True)
    ahead = torch.cumsum(exact[order], 0) - exact[order]
    keep = torch.zeros(12, dtype=torch.bool)
    keep[order[ahead <= top_p]] = True
    q = torch.where(keep, exact, torch.zeros(())).numpy()
    q /= q.sum()
    requests = [
        _request(i, RowParams(temperature=temperature, top_p=top_p, seed=i), 2, 10, 0) for i in range(n)
    ]
    sampler = DraftRowSampler(requests, torch.device("cpu"))
    for step in range(2):
        counts = np.bincount(sampler.pick_rows(row.expand(n, -1), step).numpy(), minlength=12)
        assert counts[q == 0].sum() == 0  # nothing outside the nucleus
        cells = q * n >= 5
        expected = q[cells] * n
        stat = float((((counts[cells] - expected) ** 2) / expected).sum())
        assert stat < _chi2_critical(int(cells.sum()) - 1), stat


def test_a_row_sampler_of_the_wrong_size_is_refused():
    from deepinfer_model.models.deepseek_v41 import drafter

    class Two:
        num_rows = 2

        def pick_rows(self, logits, step):
            return torch.argmax(logits, dim=-1)

    with pytest.raises(ValueError, match="row sampler drafts 2 rows, not 1 sequences"):
        drafter.draft_blocks(
            SimpleNamespace(sliding_window=4),
            None,
            torch.zeros(4, 2),
            None,
            torch.zeros(1, 1, 1, 2),
            [0],
            [0],
            2,
            Two(),
        )


class HostReads(TorchFunctionMode):
    """Counts `.cpu()` copies and host reads of tensor values (item, tolist, numpy, bool / int / float /
    index): on CUDA each one waits for the device."""

    READS = {"cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS and args and isinstance(args[0], torch.Tensor):
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_draft_batch_draws_without_a_host_read_and_with_explicit_devices():
    """Building the sampler, every draft step and the q rows: no device-to-host read, and no tensor
    factory without an explicit device (strict_device), so the same code runs unchanged on CUDA."""
    from deepinfer_model.testing import strict_device

    gen = torch.Generator().manual_seed(8)
    requests = [_request(i, p, 3, base=20 + i, accepted=i % 2) for i, p in enumerate(MIXES["mixed"])]
    steps = [torch.randn(len(requests), VOCAB, generator=gen) for _ in range(3)]
    reads = HostReads()
    with strict_device(), reads:
        sampler = DraftRowSampler(requests, torch.device("cpu"))
        for s, logits in enumerate(steps):
            sampler.pick_rows(logits, s)
        probs = sampler.probs()
    assert reads.seen == []
    assert [q is None for q in probs] == [p.greedy for p in MIXES["mixed"]]


def _naive_draw(q: np.ndarray, u: float) -> int:
    """Inverse CDF written out: accumulate the float64 weights in vocabulary order, take the first token
    whose running total exceeds u * total; when none does (u * total rounded up to the total), the last
    token of positive weight; a row without any (no token left) gives the last id, as the sampler does."""
    running, cdf = 0.0, []
    for w in q.tolist():
        running += w
        cdf.append(running)
    x = u * running
    for token, c in enumerate(cdf):
        if c > x:
            return token
    positive = np.flatnonzero(q > 0)
    return int(positive[-1]) if len(positive) else len(q) - 1


def _random_params(rng: np.random.Generator, vocab: int) -> RowParams:
    if rng.random() < 0.25:
        return RowParams(temperature=0.0, seed=int(rng.integers(0, 2**63)))
    return RowParams(
        temperature=float(rng.uniform(0.05, 2.0)),
        top_p=float(rng.choice([1.0, rng.uniform(0.05, 1.0)])),
        top_k=int(rng.choice([-1, rng.integers(1, vocab + 1)])),
        min_p=float(rng.choice([0.0, rng.uniform(0.0, 0.3)])),
        seed=int(rng.integers(0, 2**64, dtype=np.uint64)),
    )


@pytest.mark.parametrize("vocab", [61, 4099])
@pytest.mark.parametrize("trial", range(4))
def test_random_batches_draw_the_naive_per_row_tokens(trial, vocab):
    """A batch of random greedy and sampled rows (temperatures, top-p, top-k, min-p, 64-bit seeds, base
    positions, accepted counts, coupled or offset draft streams), one of them with no token left at a
    step: every draft and every q row equal, bitwise, those of drawing each row alone by the naive
    inverse CDF above with the scalar stream's uniform at the draft's position."""
    rng = np.random.default_rng(1000 * trial + vocab)
    n, k = int(rng.integers(1, 13)), int(rng.integers(1, 6))
    requests = []
    for i in range(n):
        params = _random_params(rng, vocab)
        coupled = bool(rng.integers(0, 2))
        requests.append(
            DraftRequest(
                i,
                [1, 2, 3],
                4,
                k,
                params,
                int(rng.integers(0, 10**6)),
                int(rng.integers(0, k + 1)),
                draft_seed=params.seed if coupled else None,
            )
        )
    # the drafter's logits: FP32 values in the float64 carrier
    steps = [torch.from_numpy(rng.standard_normal((n, vocab)) * 3).float().double() for _ in range(k)]
    steps[int(rng.integers(0, k))][int(rng.integers(0, n))] = float("-inf")  # a row with no token left
    sampler = DraftRowSampler(requests, torch.device("cpu"))
    got = torch.stack([sampler.pick_rows(logits, s) for s, logits in enumerate(steps)], dim=1)
    for r, req in enumerate(requests):
        q_rows = []
        for s, logits in enumerate(steps):
            if req.params.greedy:
                assert got[r, s] == int(np.argmax(logits[r].numpy())), (r, s)
                continue
            q = torch.nan_to_num(filtered_probs(logits[r][None].float(), [req.params])[0].double(), nan=0.0)
            u = stream_uniform(
                req.draft_stream_seed, draft_position(req.base_position, req.num_accepted, s), Purpose.SAMPLE
            )
            assert got[r, s] == _naive_draw(q.numpy(), u), (r, s)
            q_rows.append(q)
        q = sampler.probs()[r]
        assert (q is None) == req.params.greedy
        if q is not None:
            assert torch.equal(q, torch.stack(q_rows))
