"""Drafters: who proposes the draft tokens a decode step verifies.

A drafter gets, per sequence, the tokens whose KV is committed (`context`), the token the last step
emitted (`next_token`, fed first in the next step) and how many drafts to propose; it returns the
draft ids, a confidence per draft (the estimated acceptance probability, used by the varlen rule
and the calibration statistics) and, for sampled requests, the distribution q each draft was drawn
from (rejection sampling needs it to stay exact).

* `ModelDrafter` — the checkpoint's own DSpark draft blocks (`model.forward(..., num_draft_tokens=k)`).
  Sampled requests draw draft i from the request's filtered distribution of the drafter logits with
  the request's draft stream (seed + DRAFT_SEED_OFFSET, `draft_position`), so runs are reproducible.
  A request's logits processors (bias, bans, penalties) shape its drafts as they shape its tokens,
  the earlier drafts counting as output: drafts the target would refuse are not proposed. The
  verifier applies them to the target rows regardless, so they keep outputs exact either way.
  On the recompute runner this is one extra stateless forward per sequence and step.
* `PagedDrafter` — the same drafts read from the paged runner's cached drafter keys (the default with
  the paged runner): no extra forward.
* `OracleDrafter` — NOT for serving: proposes the target's own greedy continuation, computed with
  the stateless model (k extra forwards per sequence). Under greedy decoding every draft is accepted,
  which shows the mechanism's ceiling and overhead in tests and benchmarks.

Devices: the drafted tokens stay on the model's device through the draft loop (the sampler returns
0-d device tensors, so the model feeds them to the next draft step without a host round trip); a
sampled request's uniforms are computed on the host from integers, as always, and sent once per
request; `propose` brings every request's tokens and confidences to the host in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch
from deepinfer_model import RowParams, filtered_probs, model_device, process_logits_, to_device
from deepinfer_spec import DRAFT_SEED_OFFSET, Purpose, draft_position, inverse_cdf, stream_uniform


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
    request's filtered distribution with its draft stream; remembers q for rejection sampling.
    Returns the token as a 0-d tensor on the logits' device (no host sync per draft step)."""

    def __init__(self, req: DraftRequest) -> None:
        self.req = req
        self.probs: list[torch.Tensor] = []
        self.uniforms: torch.Tensor | None = None
        self.drafted: list[int] = []  # host copies, read only when the request's processors need them

    def _uniforms(self, device: torch.device) -> torch.Tensor:
        """Every draft step's uniform of this request (host, from integers), in one copy to `device`."""
        if self.uniforms is None:
            p, r = self.req.params, self.req
            u = [
                stream_uniform(
                    p.seed + DRAFT_SEED_OFFSET,
                    draft_position(r.base_position, r.num_accepted, s),
                    Purpose.SAMPLE,
                )
                for s in range(r.num_drafts)
            ]
            self.uniforms = to_device(np.array(u, dtype=np.float64), device, torch.float64)
        return self.uniforms

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        p = self.req.params
        if p.processed:
            # draft `step` follows the drafts before it: they are output tokens to its processors
            row = replace(p, output_token_ids=p.output_token_ids + tuple(self.drafted))
            logits = process_logits_(logits[None].float().clone(), [row])[0]
        if p.greedy:
            token = torch.argmax(logits)  # first maximum = lowest id
        else:
            q = filtered_probs(logits[None].float(), [p])[0].double()
            self.probs.append(q)
            token = inverse_cdf(q[None], self._uniforms(q.device)[step : step + 1])[0]
        if p.processed:
            self.drafted.append(int(token))  # (a host read per draft, for such requests only)
        return token


def _to_host(drafted: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> list[Drafts]:
    """(tokens, confidence, q) device tensors per request -> Drafts, in one device-to-host copy
    (float64 holds every token id and float32 confidence exactly)."""
    if not drafted:
        return []
    host = torch.cat([t for tok, conf, _ in drafted for t in (tok.double(), conf.clamp(0.0, 1.0).double())])
    values, out, at = host.cpu().tolist(), [], 0
    for tok, _, probs in drafted:
        n = tok.shape[0]
        out.append(Drafts([int(t) for t in values[at : at + n]], values[at + n : at + 2 * n], probs))
        at += 2 * n
    return out


class ModelDrafter:
    def __init__(self, model) -> None:
        self.model = model
        self.device = model_device(model)

    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        return _to_host([self.draft(req) for req in requests])

    def draft(self, req: DraftRequest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One request's drafted tokens, confidences and q rows, on the model's device."""
        sampler = _DraftSampler(req)
        res = self.model.forward(
            to_device(np.asarray(req.context, dtype=np.int64), self.device, torch.long),
            num_draft_tokens=req.num_drafts,
            next_token=req.next_token,
            sampler=sampler,
            logit_rows=[-1],
        )
        probs = torch.stack(sampler.probs) if sampler.probs else None
        return res.draft.tokens, res.draft.confidence, probs


class PagedDrafter:
    """The checkpoint's DSpark draft blocks read from the paged runner's cached drafter keys: no extra
    forward of the target. Drafts after each sequence's last accepted position of the step just run
    (equal to `ModelDrafter`'s stateless drafts, tested); the requests with the same draft count draft
    in one batched forward (a greedy group through the runner's draft CUDA graph when it has one); a
    sequence that was not in that step falls back to `ModelDrafter`."""

    def __init__(self, runner, model) -> None:
        self.runner = runner
        self.fallback = ModelDrafter(model)

    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        out: list = [None] * len(requests)
        groups: dict[int, list[tuple[int, int]]] = {}  # num_drafts -> (request, batch index)
        for r, req in enumerate(requests):
            index = self.runner.last_step_index(req.seq_id)
            if index is None:
                out[r] = self.fallback.draft(req)
            else:
                groups.setdefault(req.num_drafts, []).append((r, index))
        # one batched draft forward per draft length (a block's length changes its bidirectional
        # attention, so blocks of different lengths cannot share a forward), each request its sampler
        for num_drafts, members in groups.items():
            reqs = [requests[r] for r, _ in members]
            # a group of greedy requests without logits processors drafts with the greedy marker
            # (sampler None: the argmax of every row on the device, no q to keep), which lets the
            # runner replay its draft CUDA graph; the engine reads tokens and confidences only
            greedy = all(req.params.greedy and not req.params.processed for req in reqs)
            samplers = None if greedy else [_DraftSampler(req) for req in reqs]
            drafts = self.runner.draft(
                [req.next_token for req in reqs],
                num_drafts,
                seq_indices=[index for _, index in members],
                sampler=samplers,
                last_positions=[len(req.context) - 1 for req in reqs],
                tokens_only=True,
            )
            for j, ((r, _), d) in enumerate(zip(members, drafts)):
                probs = None if greedy or not samplers[j].probs else torch.stack(samplers[j].probs)
                out[r] = (d.tokens, d.confidence, probs)
        return _to_host(out)


class OracleDrafter:
    """Test / benchmark tool: the target's greedy continuation after next_token (confidence 1)."""

    def __init__(self, model) -> None:
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.device = model_device(model)

    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        out = []
        for req in requests:
            # the continuation stays on the device: each argmax feeds the next forward without a sync
            ids = to_device(
                np.asarray([*req.context, req.next_token], dtype=np.int64), self.device, torch.long
            )
            for _ in range(req.num_drafts):
                res = self.model.forward(ids)
                logits = res.logits if hasattr(res, "logits") else res  # V4.1 returns a V41Output
                ids = torch.cat([ids, torch.argmax(logits[-1]).reshape(1)])
            tokens = ids[ids.shape[0] - req.num_drafts :]
            probs = None
            if not req.params.greedy:  # a deterministic drafter: q is one-hot at its draft
                probs = torch.zeros(len(tokens), self.vocab_size, dtype=torch.float64, device=self.device)
                probs[torch.arange(len(tokens), device=self.device), tokens] = 1.0
            out.append((tokens, torch.ones(len(tokens), dtype=torch.float32, device=self.device), probs))
        return _to_host(out)
