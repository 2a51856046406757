"""A small deterministic n-gram "language model" and drafters for tests and benchmarks.

NOT a real model: the target is a fixed random table of logits indexed by the last `order` tokens.
It is an independent target against which verification can be checked exactly (greedy decoding and
the exact next-token distributions are easy to compute). `run_toy_decode` is the decode loop with
drafts written against this package's API, i.e. the sequence of calls the engine loop makes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .coupled import coupled_agreement, draft_stream_seed
from .random_stream import Purpose, draft_position, stream_uniform
from .state import SpecDecodeState
from .stats import SpecStats
from .varlen import ConfidenceScheduler, VerifyPlan
from .verify import DraftVerifier, inverse_cdf


class NGramModel:
    """logits(context) = table[last `order` tokens] (missing history counts as token 0)."""

    def __init__(self, vocab: int, order: int = 2, seed: int = 0, scale: float = 2.0) -> None:
        if vocab < 2 or order < 1:
            raise ValueError(f"vocab must be >= 2 and order >= 1, got {vocab} and {order}")
        gen = torch.Generator().manual_seed(seed)
        self.vocab, self.order = vocab, order
        self.table = torch.randn(vocab**order, vocab, generator=gen, dtype=torch.float64) * scale

    def _index(self, context: Sequence[int]) -> int:
        idx = 0
        tail = list(context[-self.order :])
        for tok in [0] * (self.order - len(tail)) + tail:
            idx = idx * self.vocab + int(tok)
        return idx

    def logits(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.table[[self._index(c) for c in contexts]]

    def probs(self, contexts: Sequence[Sequence[int]], temperature: float = 1.0) -> torch.Tensor:
        return torch.softmax(self.logits(contexts) / (temperature if temperature > 0 else 1.0), dim=-1)


@dataclass
class Drafts:
    tokens: list[int]
    probs: torch.Tensor  # [n, V]
    confidences: list[float]


class Drafter:
    """Drafts from q = alpha * target + (1 - alpha) * own random table, sampled sequentially with the
    request's draft stream (`draft_stream_seed`: the target's own stream when coupled, spec §5.4's
    offset stream for rejection sampling). alpha = 1 is the oracle (proposes the target's own next
    tokens: its argmax under greedy, a sample from the target's own distribution otherwise; coupled, the
    very token the target draws); alpha = 0 is an unrelated random drafter. The confidence is the exact
    acceptance probability (coupled: `coupled_agreement`; rejection: Σ min(p, q)): a perfectly
    calibrated stand-in for the learned confidence head."""

    def __init__(self, target: NGramModel, alpha: float, seed: int = 1) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.target, self.alpha = target, alpha
        self.own = NGramModel(target.vocab, target.order, seed=seed)

    def propose(
        self,
        context: list[int],
        n: int,
        temperature: float,
        seed: int,
        base: int,
        accepted: int,
        coupled: bool = True,
    ) -> Drafts:
        """`seed`: the request's (target) seed; `coupled`: the verifier's mode (`DraftVerifier.coupled`)."""
        tokens, rows, confs = [], [], []
        ctx = list(context)
        for i in range(n):
            p = self.target.probs([ctx], temperature)[0]
            q = self.alpha * p + (1 - self.alpha) * self.own.probs([ctx], temperature)[0]
            if temperature == 0:
                tok = int(torch.argmax(q))
                confs.append(float(torch.argmax(p) == tok))
            else:
                u = stream_uniform(
                    draft_stream_seed(seed, coupled), draft_position(base, accepted, i), Purpose.SAMPLE
                )
                tok = int(inverse_cdf(q[None], torch.tensor([u], dtype=torch.float64, device=q.device))[0])
                agree = coupled_agreement(p[None], q[None])[0] if coupled else torch.minimum(p, q).sum()
                confs.append(float(agree.clamp(0, 1)))
            tokens.append(tok)
            rows.append(q)
            ctx.append(tok)
        return Drafts(tokens, torch.stack(rows) if rows else torch.zeros(0, self.target.vocab), confs)


@dataclass
class ToyRun:
    outputs: list[list[int]]
    stats: SpecStats
    plans: list[VerifyPlan] = field(default_factory=list)
    seconds: float = 0.0  # whole loop, toy target and drafter included
    spec_seconds: float = 0.0  # this package's calls only: choose, pack, verify, commit, record


def run_toy_decode(
    target: NGramModel,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    nextn: int,
    temperature: float = 0.0,
    seeds: Sequence[int] | None = None,
    scheduler: ConfidenceScheduler | None = None,
    verifier: DraftVerifier | None = None,
) -> ToyRun:
    """Batched synchronous decode with drafts; every request generates exactly max_new_tokens."""
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    scheduler = scheduler or ConfidenceScheduler(nextn)
    verifier = verifier or DraftVerifier()
    state, stats = SpecDecodeState(nextn), SpecStats(nextn)
    contexts = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    for i, seed in enumerate(seeds):
        state.add(i, seed)
    greedy = temperature == 0
    run = ToyRun(outputs, stats)
    start = time.perf_counter()
    while True:
        ids = [i for i in range(len(prompts)) if len(outputs[i]) < max_new_tokens]
        if not ids:
            break
        # 1. how many drafts each request verifies; 2. the packed drafts.
        tick = time.perf_counter()
        plan = scheduler.choose(state.varlen_inputs(ids))
        state.mark_scheduled(ids)
        draft_tokens, draft_probs, confs = state.pack(ids, plan)
        run.spec_seconds += time.perf_counter() - tick
        # 3. target forward on [g, d1..dk] per request (here: table look-ups).
        rows, offset = [], 0
        for i, k in zip(ids, plan.num_verify):
            drafts = draft_tokens[offset : offset + k].tolist()
            offset += k
            rows.extend(contexts[i] + drafts[:j] for j in range(k + 1))
        target_probs = target.probs(rows, temperature)
        base = [len(contexts[i]) for i in ids]
        tick = time.perf_counter()
        # 4. verification, 5. bookkeeping (the engine would roll back caches from `rollbacks`).
        result = verifier.verify(
            target_probs,
            draft_tokens,
            plan.num_verify,
            seeds=[seeds[i] for i in ids],
            base_positions=base,
            greedy=[greedy] * len(ids),
            draft_probs=draft_probs,
        )
        state.commit(ids, result)
        stats.record_step(plan.num_verify, result.num_accepted, confs, result.accept_probs.tolist())
        run.spec_seconds += time.perf_counter() - tick
        run.plans.append(plan)
        # 6. append emitted tokens, then 7. the drafter proposes for the next step.
        for n, i in enumerate(ids):
            room = max_new_tokens - len(outputs[i])
            emitted = result.emitted[n][:room]
            outputs[i].extend(emitted)
            contexts[i].extend(emitted)
            if drafter is not None and nextn > 0 and len(outputs[i]) < max_new_tokens:
                d = drafter.propose(
                    contexts[i],
                    nextn,
                    temperature,
                    seeds[i],
                    base[n],
                    result.num_accepted[n],
                    coupled=verifier.coupled,
                )
                state.propose(i, d.tokens, d.confidences, d.probs)
    run.seconds = time.perf_counter() - start
    return run


def greedy_reference(target: NGramModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Plain step-by-step greedy decoding of the target (the reference for greedy verification)."""
    ctx, out = list(prompt), []
    for _ in range(max_new_tokens):
        tok = int(torch.argmax(target.logits([ctx])[0]))
        out.append(tok)
        ctx.append(tok)
    return out
