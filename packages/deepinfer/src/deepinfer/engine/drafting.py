"""Drafters: who proposes the draft tokens a decode step verifies.

A drafter gets, per sequence, the tokens whose KV is committed (`context`), the token the last step
emitted (`next_token`, fed first in the next step) and how many drafts to propose; it returns the
draft ids, a confidence per draft (the estimated acceptance probability, used by the varlen rule
and the calibration statistics) and, for sampled requests, the distribution q each draft was drawn
from (rejection sampling needs it to stay exact).

* `ModelDrafter` — the checkpoint's own DSpark draft blocks (`model.forward(..., num_draft_tokens=k)`).
  Sampled requests draw draft i from the request's filtered distribution of the drafter logits with
  the request's draft stream (seed + DRAFT_SEED_OFFSET, `draft_position`), so runs are reproducible.
  On the recompute runner this is one extra stateless forward per sequence and step.
* `PagedDrafter` — the same drafts read from the paged runner's cached drafter keys (the default with
  the paged runner): no extra forward.
* `OracleDrafter` — NOT for serving: proposes the target's own greedy continuation, computed with
  the stateless model (k extra forwards per sequence). Under greedy decoding every draft is accepted,
  which shows the mechanism's ceiling and overhead in tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from deepinfer_model.sampling import Purpose, RowParams, filtered_probs, stream_uniform
from deepinfer_spec import DRAFT_SEED_OFFSET, draft_position
from deepinfer_spec.verify import inverse_cdf


@dataclass
class DraftRequest:
    seq_id: int
    context: list[int]  # tokens with committed KV (prompt + generated, without next_token)
    next_token: int  # the token emitted last; the next step feeds [next_token, d1..dk]
    num_drafts: int  # >= 1
    params: RowParams  # the request's sampling (temperature 0: greedy drafts)
    base_position: int  # plain decode position of the step that emitted next_token
    num_accepted: int  # drafts that step accepted (keys the draft stream, spec §5.4)


@dataclass
class Drafts:
    tokens: list[int]
    confidences: list[float]  # in [0, 1], one per draft
    probs: torch.Tensor | None = None  # [len(tokens), V] q of each draft (sampled requests only)


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Drafts]: ...


class _DraftSampler:
    """The `sampler(logits, step)` callback of the model's draft loop: greedy, or a draw from the
    request's filtered distribution with its draft stream; remembers q for rejection sampling."""

    def __init__(self, req: DraftRequest) -> None:
        self.req = req
        self.probs: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, step: int) -> int:
        p = self.req.params
        if p.greedy:
            return int(torch.argmax(logits))
        q = filtered_probs(logits[None].float(), [p])[0].double()
        self.probs.append(q)
        u = stream_uniform(
            p.seed + DRAFT_SEED_OFFSET,
            draft_position(self.req.base_position, self.req.num_accepted, step),
            Purpose.SAMPLE,
        )
        return int(inverse_cdf(q[None], torch.tensor([u], dtype=torch.float64))[0])


class ModelDrafter:
    def __init__(self, model) -> None:
        self.model = model

    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        out = []
        for req in requests:
            sampler = _DraftSampler(req)
            res = self.model.forward(
                torch.tensor(req.context, dtype=torch.long),
                num_draft_tokens=req.num_drafts,
                next_token=req.next_token,
                sampler=sampler,
                logit_rows=[-1],
            )
            d = res.draft
            probs = torch.stack(sampler.probs) if sampler.probs else None
            conf = d.confidence.clamp(0.0, 1.0).tolist()
            out.append(Drafts(d.tokens.tolist(), conf, probs))
        return out


class PagedDrafter:
    """The checkpoint's DSpark draft blocks read from the paged runner's cached drafter keys: no extra
    forward of the target. Drafts after each sequence's last accepted position of the step just run
    (equal to `ModelDrafter`'s stateless drafts, tested); a sequence that was not in that step falls
    back to `ModelDrafter`."""

    def __init__(self, runner, model) -> None:
        self.runner = runner
        self.fallback = ModelDrafter(model)

    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        out = []
        for req in requests:
            index = self.runner.last_step_index(req.seq_id)
            if index is None:
                out.extend(self.fallback.propose([req]))
                continue
            sampler = _DraftSampler(req)
            (d,) = self.runner.draft(
                [req.next_token],
                req.num_drafts,
                seq_indices=[index],
                sampler=sampler,
                last_positions=[len(req.context) - 1],
            )
            probs = torch.stack(sampler.probs) if sampler.probs else None
            out.append(Drafts(d.tokens.tolist(), d.confidence.clamp(0.0, 1.0).tolist(), probs))
        return out


class OracleDrafter:
    """Test / benchmark tool: the target's greedy continuation after next_token (confidence 1)."""

    def __init__(self, model) -> None:
        self.model = model
        self.vocab_size = int(model.config.vocab_size)

    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        out = []
        for req in requests:
            ids = [*req.context, req.next_token]
            tokens = []
            for _ in range(req.num_drafts):
                res = self.model.forward(torch.tensor(ids, dtype=torch.long))
                logits = res.logits if hasattr(res, "logits") else res  # V4.1 returns a V41Output
                tokens.append(int(torch.argmax(logits[-1])))
                ids.append(tokens[-1])
            probs = None
            if not req.params.greedy:  # a deterministic drafter: q is one-hot at its draft
                probs = torch.zeros(len(tokens), self.vocab_size, dtype=torch.float64)
                probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
            out.append(Drafts(tokens, [1.0] * len(tokens), probs))
        return out
