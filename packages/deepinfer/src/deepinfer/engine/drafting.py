"""Drafters: who proposes the draft tokens a decode step verifies.

A drafter gets, per sequence, the tokens whose KV is committed (`context`), the token the last step
emitted (`next_token`, fed first in the next step) and how many drafts to propose; it returns the
draft ids, a confidence per draft (the estimated acceptance probability, used by the varlen rule
and the calibration statistics) and, for sampled requests, the distribution q each draft was drawn
from (rejection sampling needs it to stay exact).

* `ModelDrafter` — the checkpoint's own DSpark draft blocks (`model.forward(..., num_draft_tokens=k)`).
  Sampled requests draw draft i from the request's filtered distribution of the drafter logits with
  the request's draft stream at the draft's token position (`draft_position`), so runs are
  reproducible: the target's own stream under coupled verification (the default: a draft shares the
  uniform of the plain draw at its position, so a drafter near the target proposes that very token),
  seed + DRAFT_SEED_OFFSET under rejection sampling (`DraftRequest.draft_seed`).
  A request's logits processors (bias, bans, penalties) shape its drafts as they shape its tokens,
  the earlier drafts counting as output: drafts the target would refuse are not proposed. The
  verifier applies them to the target rows regardless, so they keep outputs exact either way.
  On the recompute runner this is one extra stateless forward per sequence and step.
* `PagedDrafter` — the same drafts read from the paged runner's cached drafter keys (the default with
  the paged runner): no extra forward.
* `OracleDrafter` — NOT for serving: proposes the target's own greedy continuation, computed with
  the stateless model (k extra forwards per sequence). Under greedy decoding every draft is accepted,
  which shows the mechanism's ceiling and overhead in tests and benchmarks.
* `RecordedDrafter` — NOT for serving: proposes each prompt's continuation recorded from a run with
  drafts off (or, `wrong=True`, every draft shifted off it), at no model cost: the ceiling of drafts
  that are always right without the stateless forwards that `OracleDrafter` pays for.

Devices: the drafted tokens stay on the model's device through the draft loop. `DraftRowSampler`
draws draft s of every sequence of a draft batch at once (greedy and sampled rows, tensor ops, uniforms
computed on the device from the counter-based stream), so a batch costs no per-sequence or per-position
Python and no host sync; `propose` brings every request's tokens and confidences to the host in one copy.
Where the paged runner has draft CUDA graphs, a group without logits processors draws inside the graph
instead (greedy, or sampled with the sampler's streams and filters: `runtime.draft_sampling`, the same
tokens and q bit for bit on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch
from deepinfer_model import (
    DraftSampling,
    RowParams,
    filtered_probs,
    model_device,
    process_logits_,
    to_device,
)
from deepinfer_spec import (
    DRAFT_SEED_OFFSET,
    Purpose,
    draft_position,
    int64_bits,
    inverse_cdf,
    stream_uniforms_tensor,
)


@dataclass
class DraftRequest:
    seq_id: int
    context: list[int]  # tokens with committed KV (prompt + generated, without next_token)
    next_token: int  # the token emitted last; the next step feeds [next_token, d1..dk]
    num_drafts: int  # >= 1
    params: RowParams  # the request's sampling (temperature 0: greedy drafts)
    base_position: int  # plain decode position of the step that emitted next_token
    num_accepted: int  # drafts that step accepted (keys the draft stream, spec §5.4)
    # seed of the draft stream (`DraftVerifier.draft_seed`: params.seed when verification is coupled);
    # None: params.seed + DRAFT_SEED_OFFSET, the stream rejection sampling needs
    draft_seed: int | None = None

    @property
    def draft_stream_seed(self) -> int:
        return self.params.seed + DRAFT_SEED_OFFSET if self.draft_seed is None else self.draft_seed


@dataclass
class Drafts:
    tokens: list[int]
    confidences: list[float]  # in [0, 1], one per draft
    probs: torch.Tensor | None = None  # [len(tokens), V] q of each draft (sampled requests only)


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Drafts]: ...


class DraftRowSampler:
    """The seeded draft sampler of a draft batch (the model's `RowSampler`): draft s of every row in one
    pass of tensor ops. Greedy rows take the argmax of their logits; sampled rows draw by inverse CDF
    from their request's filtered distribution (`filtered_probs`, the sampler's one logits transform)
    with their draft stream: `DraftRequest.draft_stream_seed` at `draft_position(base, accepted, s)`. Row for
    row these are the draws of sampling each request alone (tested bitwise against recorded drafts).

    The uniforms of every sampled row and draft step are computed on the device at the first draw
    (`stream_uniforms_tensor`) from one host-to-device copy of the rows' keys; q of each step is kept
    (rejection sampling needs it). `static_sampling` describes the rows to the sampled draft graph,
    which then draws in the sampler's place (and this sampler draws nothing). Nothing is read back to
    the host, except for rows whose logits processors (penalties, bad words) read the seen tokens: their
    drafts so far are output tokens to the next draft's processors, read back once per draft step."""

    def __init__(self, requests: list[DraftRequest], device: torch.device) -> None:
        self.requests = requests
        self.device = device
        self.num_rows = len(requests)
        self.params = [r.params for r in requests]
        self.processed = [i for i, r in enumerate(requests) if r.params.processed]
        self.processed_at = torch.as_tensor(self.processed, dtype=torch.long, device=device)
        self.drafted: dict[int, list[int]] = {row: [] for row in self.processed}
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        self.sampled_params = [requests[i].params for i in sampled]
        self.every_row_sampled = len(sampled) == len(requests)  # (no row gathered, no argmax)
        self.slot = {row: m for m, row in enumerate(sampled)}  # row -> its index among sampled rows
        self.q: torch.Tensor | None = None  # [M, steps, V] float64: q of each sampled row and draft step
        self.steps_drawn = 0
        self.cdf: torch.Tensor | None = None
        if not sampled:
            return
        self.steps = max(requests[i].num_drafts for i in sampled)
        self._keys = np.stack(
            [
                np.asarray(sampled, dtype=np.int64),
                int64_bits([requests[i].draft_stream_seed for i in sampled]),
                np.asarray(
                    [draft_position(requests[i].base_position, requests[i].num_accepted, 0) for i in sampled],
                    dtype=np.int64,
                ),
            ]
        )
        self.uniforms: torch.Tensor | None = None

    def _draw_uniforms(self) -> None:
        at, seeds, first = to_device(self._keys, self.device, torch.long)  # one copy
        self.at = at
        later = torch.arange(self.steps, dtype=torch.long, device=self.device)
        # [steps, M]: row s holds every sampled row's uniform of draft step s (its position is step 0's + s)
        self.uniforms = stream_uniforms_tensor(
            seeds[None, :].expand(self.steps, -1), first[None, :] + later[:, None], Purpose.SAMPLE
        )

    def static_sampling(self) -> DraftSampling | None:
        """The rows as the sampled draft graph takes them (`runtime.draft_sampling`: it draws with these
        very streams and filters), or None when a row has logits processors (they read the drafts so far
        on the host, which a graph cannot)."""
        if self.processed:
            return None
        reqs = self.requests
        return DraftSampling(
            tuple(r.params for r in reqs),
            int64_bits([r.draft_stream_seed for r in reqs]),
            np.asarray([draft_position(r.base_position, r.num_accepted, 0) for r in reqs], dtype=np.int64),
        )

    def pick_rows(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        if self.processed:
            logits = self._process(logits)
        if self.sampled_params:
            if self.uniforms is None:
                self._draw_uniforms()
            sampled = logits if self.every_row_sampled else logits[self.at]
            # a row whose processors left no token has no q (softmax of -inf everywhere is NaN): a zero
            # row, whose draft the verifier rejects (the target has no token there either). (Zeroed in
            # float32, then widened into the kept q: probabilities are never infinite, so that is the
            # float64 q's zeroing, one float64 pass less.)
            probs = filtered_probs(sampled.float(), self.sampled_params).nan_to_num_(nan=0.0)
            if self.q is None:
                self.q = probs.new_empty(probs.shape[0], self.steps, probs.shape[1], dtype=torch.float64)
            q = self.q[:, step]
            q.copy_(probs)
            self.steps_drawn = max(self.steps_drawn, step + 1)
            if self.cdf is None:
                self.cdf = torch.empty_like(probs, dtype=torch.float64)
            drawn = inverse_cdf(q, self.uniforms[step], cdf=self.cdf)  # (one CDF buffer for every step)
            if self.every_row_sampled:
                tokens = drawn
            else:
                tokens = torch.argmax(logits, dim=-1).index_copy(
                    0, self.at, drawn
                )  # first maximum = lowest id
        else:
            tokens = torch.argmax(logits, dim=-1)  # first maximum = lowest id
        if self.processed:
            for row, token in zip(self.processed, tokens[self.processed_at].tolist(), strict=True):
                self.drafted[row].append(token)
        return tokens

    def _process(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed rows' logits through their processors, the drafts before this one counted as
        output (as verification will count them)."""
        rows = [
            replace(self.params[r], output_token_ids=self.params[r].output_token_ids + tuple(self.drafted[r]))
            for r in self.processed
        ]
        logits = logits.float().clone()
        logits[self.processed_at] = process_logits_(logits[self.processed_at], rows)
        return logits

    def probs(self) -> list[torch.Tensor | None]:
        """Per row: q of its drafts [k, V] (float64), None for a greedy row. The rows of the sampled
        requests are views of one tensor, request after request (`cat_rows` joins them without a copy)."""
        if self.q is None:
            return [None] * self.num_rows
        q = self.q[:, : self.steps_drawn]
        return [q[self.slot[row]] if row in self.slot else None for row in range(self.num_rows)]


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
        sampler = DraftRowSampler([req], self.device)
        res = self.model.forward(
            to_device(np.asarray(req.context, dtype=np.int64), self.device, torch.long),
            num_draft_tokens=req.num_drafts,
            next_token=req.next_token,
            sampler=sampler,
            logit_rows=[-1],
        )
        return res.draft.tokens, res.draft.confidence, sampler.probs()[0]


class PagedDrafter:
    """The checkpoint's DSpark draft blocks read from the paged runner's cached drafter keys: no extra
    forward of the target. Drafts after each sequence's last accepted position of the step just run
    (equal to `ModelDrafter`'s stateless drafts, tested); the requests with the same draft count draft
    in one batched forward (through the runner's draft CUDA graph when it has one, greedy or sampled,
    unless a request has logits processors); a sequence that was not in that step falls back to
    `ModelDrafter`."""

    def __init__(self, runner, model) -> None:
        self.runner = runner
        self.fallback = ModelDrafter(model)

    def draft_forwards(self, requests: list[DraftRequest]) -> int:
        """The batched draft-block forwards `propose(requests)` runs: one per draft length (a sequence
        drafted by the fallback runs the whole stateless model instead, not counted here)."""
        return len(self._groups(requests))

    def _groups(self, requests: list[DraftRequest]) -> dict[int, list[tuple[int, int]]]:
        """num_drafts -> (request, batch index) of the requests that were in the step just run."""
        groups: dict[int, list[tuple[int, int]]] = {}
        for r, req in enumerate(requests):
            index = self.runner.last_step_index(req.seq_id)
            if index is not None:
                groups.setdefault(req.num_drafts, []).append((r, index))
        return groups

    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        out: list = [None] * len(requests)
        groups = self._groups(requests)
        for r, req in enumerate(requests):
            if self.runner.last_step_index(req.seq_id) is None:
                out[r] = self.fallback.draft(req)
        # one batched draft forward per draft length (a block's length changes its bidirectional
        # attention, so blocks of different lengths cannot share a forward), each request its sampler
        for num_drafts, members in groups.items():
            reqs = [requests[r] for r, _ in members]
            # a group of greedy requests without logits processors drafts with the greedy marker
            # (sampler None: the argmax of every row on the device, no q to keep), which lets the
            # runner replay its greedy draft CUDA graph; a sampled group without logits processors
            # replays its sampled one (the sampler describes its rows: `static_sampling`); the
            # engine reads tokens and confidences only
            greedy = all(req.params.greedy and not req.params.processed for req in reqs)
            sampler = None if greedy else DraftRowSampler(reqs, self.fallback.device)
            drafts = self.runner.draft(
                [req.next_token for req in reqs],
                num_drafts,
                seq_indices=[index for _, index in members],
                sampler=sampler,
                last_positions=[len(req.context) - 1 for req in reqs],
                tokens_only=True,
            )
            if greedy:
                probs = [None] * len(reqs)
            elif sampler.q is not None:  # the eager draft: the sampler drew and kept q
                probs = sampler.probs()
            else:  # the sampled draft graph drew in its place (or no row sampled): q in the outputs,
                # None for greedy rows
                probs = [d.probs for d in drafts]
            for (r, _), d, q in zip(members, drafts, probs):
                out[r] = (d.tokens, d.confidence, q)
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


class RecordedDrafter:
    """Test / benchmark tool: drafts from recorded continuations. `sequences` are whole token lists
    (prompt + the greedy output of a run with drafts off); a request drafts the tokens that follow what it
    has seen in the one sequence that starts with it, padded with token 0 past the recording's end
    (wrong, so rejected). `wrong=True` shifts every draft by one id: always wrong. Confidence
    `confidence` for every draft; greedy requests only (no q)."""

    def __init__(
        self, sequences: list[list[int]], vocab_size: int, wrong: bool = False, confidence: float = 0.9
    ) -> None:
        self.sequences = [list(s) for s in sequences]
        self.vocab_size, self.wrong, self.confidence = vocab_size, wrong, confidence

    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        out = []
        for req in requests:
            if not req.params.greedy:
                raise ValueError("RecordedDrafter drafts for greedy requests only (temperature 0)")
            seen = [*req.context, req.next_token]
            full = next((s for s in self.sequences if s[: len(seen)] == seen), None)
            if full is None:
                raise KeyError(
                    f"sequence {req.seq_id}: no recorded sequence starts with its {len(seen)} tokens"
                )
            tokens = full[len(seen) : len(seen) + req.num_drafts]
            tokens += [0] * (req.num_drafts - len(tokens))
            if self.wrong:
                tokens = [(t + 1) % self.vocab_size for t in tokens]
            out.append(Drafts(tokens, [self.confidence] * len(tokens)))
        return out
