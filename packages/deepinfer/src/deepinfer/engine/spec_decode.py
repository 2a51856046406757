"""Speculative decoding in the engine loop (DSpark drafts, spec engine.md §6), through `deepinfer_spec`.

One step with drafts (synchronous loop):

1. The scheduler feeds `[g, d1..dk]` for a sequence whose drafts were set with `set_draft_tokens`
   (`k` = `num_draft_tokens`, possibly capped by max_tokens / max_model_len); the runner returns
   logits for all `1 + k` rows (`to_verify_batch`).
2. `verify_logits` turns the rows into the processed target distributions (banned tokens, grammar
   masks of every draft row, logits processors with drafts 1..j as row j's output, temperature /
   top-p / top-k / min-p) and `DraftVerifier.verify` accepts a
   prefix: greedy match, or for sampled requests the plain sampler's draw of every row with a draft
   accepted iff it equals it (coupled, the default: every emitted token is the one drafts-off decoding
   emits) or rejection sampling (DEEPINFER_SPEC_SAMPLED_VERIFY=rejection), with the request's seeded
   streams. A sequence with k = 0 (prefill end, first decode) is exactly the plain sampler's draw.
3. The engine commits the accepted drafts + the final token to the scheduler (its num_computed_tokens
   becomes start + 1 + accepted, so the rejected rows' slots are rewritten by the next step), tells the
   runner `rollback(seq_id, num_rejected)` when it has that method, and advances grammar matchers by
   exactly the emitted tokens (drafts were only accepted tentatively while masks were filled).
4. The drafter proposes up to nextn drafts after the new token; `ConfidenceScheduler.choose` picks
   how many each sequence verifies (all of them unless MTP varlen is on), `set_draft_tokens` passes
   that prefix to the scheduler. With MTP varlen on, `DraftPolicy` first decides which sequences draft
   at all and then how many of their drafts are verified (`deepinfer_spec.draft_policy`).

Runner contract for rejected drafts (for a paged runner): after `execute` of a step in which sequence
`s` verified k drafts and accepted a, the engine calls `runner.rollback(s, k - a)` (only when k - a >
0 and the runner defines it) before the next `execute`. The runner must then forget the KV / state of
the last k - a query tokens of `s` from that step (window, compressed, per-token KV, index-K,
incomplete-block state); the next step of `s` starts at start_position = old start + 1 + a, i.e. the
scheduler's `num_computed_tokens`. The recompute runner needs nothing: it recomputes from the tokens
the scheduler's positions say are valid, and the next step overwrites the rejected slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from deepinfer_model import RowParams, TokenBitmask, filtered_probs, masked_logits, to_device
from deepinfer_spec import (
    ConfidenceScheduler,
    DraftPolicy,
    DraftVerifier,
    SpecDecodeState,
    SpecStats,
    StepTimeCurve,
    VerifyPlan,
    VerifyResult,
    cat_rows,
    probe_budget_from_env,
    sampled_verify_from_env,
)

from .drafting import Drafter, DraftRequest


@dataclass
class VerifyInput:
    """One sequence that emits tokens this step: its rows' sampling params and its drafts."""

    rows: list[RowParams]  # 1 + k: row j produces the token at position base + j
    drafts: list[int]  # k
    draft_probs: torch.Tensor | None  # [k, V] q (sampled requests with drafts), else None
    golden: list[int]  # forced token per row (-1: none)

    @property
    def base_position(self) -> int:
        return self.rows[0].position


@dataclass
class VerifyOutcome:
    """Per VerifyInput (same order): the emitted tokens and their logprobs; plus the raw result."""

    result: VerifyResult
    logprobs: list[list[float] | None] = field(default_factory=list)
    top: list[list[dict[int, float]] | None] = field(default_factory=list)
    ranks: list[list[int] | None] = field(default_factory=list)


def verify_logits(
    verifier: DraftVerifier,
    logits: torch.Tensor,
    inputs: list[VerifyInput],
    allowed: TokenBitmask | None = None,
    overwrite_logits: bool = False,
) -> VerifyOutcome:
    """logits: [Σ (1 + k_i), V], the rows of `inputs` packed in order; allowed: packed grammar masks
    addressed by packed row; overwrite_logits: the caller is done with `logits`, masking may write
    into them (ignored when an input asks for logprobs, which come from the unmasked logits).

    Greedy rows keep their (masked) logits — the verifier only takes their argmax, as the plain
    sampler does; sampled rows become the sampler's filtered distribution. A row that allows no token
    stops its input there (`VerifyResult.no_token` when it is the input's final row)."""
    rows = [r for inp in inputs for r in inp.rows]
    if logits.shape[0] != len(rows):
        raise ValueError(f"logits must have one row per verify row ({len(rows)}), got {logits.shape[0]}")
    raw = logits.float()
    wants_logprobs = any(inp.rows[0].logprobs is not None for inp in inputs)
    inplace = not wants_logprobs and (overwrite_logits or raw.data_ptr() != logits.data_ptr())
    masked = masked_logits(raw, rows, allowed, inplace=inplace)  # as the plain sampler masks
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    # a row with every token masked has no distribution (the softmax of -inf everywhere is NaN): zero
    # mass, which the verifier reads as no token left, as the plain sampler reads such a row (zeroed in
    # float32 before widening: probabilities are never infinite, so that is the float64 zeroing)
    if len(sampled) == len(rows):  # (every row sampled: the distributions are the whole target)
        target = filtered_probs(masked, rows).nan_to_num_(nan=0.0).double()
    elif not sampled:  # every row greedy: the verifier takes argmaxes of the logits as they are
        target = masked
    else:
        target = masked.double()
    if sampled and len(sampled) < len(rows):
        # a Python-list index would be a pageable host->device copy, which waits for the forward to finish
        # before the sampler's kernels are launched (find_host_syncs.py); a pinned index does not
        at = to_device(np.asarray(sampled, dtype=np.int64), target.device)
        target[at] = filtered_probs(masked[at], [rows[i] for i in sampled]).nan_to_num_(nan=0.0).double()
    ks = [len(inp.drafts) for inp in inputs]
    draft_probs = None
    if any(inp.draft_probs is not None for inp in inputs):
        vocab = raw.shape[-1]
        draft_probs = cat_rows(
            [
                inp.draft_probs.to(raw.device, torch.float64)
                if inp.draft_probs is not None
                else torch.zeros(k, vocab, dtype=torch.float64, device=raw.device)
                for inp, k in zip(inputs, ks)
            ]
        )
    result = verifier.verify(
        target,
        [t for inp in inputs for t in inp.drafts],  # host ids: the verifier checks them there, one copy
        ks,
        seeds=[inp.rows[0].seed for inp in inputs],
        base_positions=[inp.base_position for inp in inputs],
        greedy=[inp.rows[0].greedy for inp in inputs],
        draft_probs=draft_probs,
        golden=[inp.golden for inp in inputs],
    )
    out = VerifyOutcome(result)
    out.logprobs, out.top, out.ranks = _emitted_logprobs(raw, inputs, result.emitted)
    return out


def _emitted_logprobs(raw: torch.Tensor, inputs: list[VerifyInput], emitted: list[list[int]]):
    """Raw model log-probabilities of each emitted token (row j of an input emits its j-th token) and
    the top-n per row, for the inputs that ask, like the plain sampler reports them. Computed on the
    logits' device; one copy to the host for the whole step (float64 holds the ids exactly)."""
    logprobs: list[list[float] | None] = [None] * len(inputs)
    top: list[list[dict[int, float]] | None] = [None] * len(inputs)
    ranks: list[list[int] | None] = [None] * len(inputs)
    rows, tokens, spans, offset = [], [], [], 0  # spans: (input, first row in `lp`, rows)
    for i, (inp, em) in enumerate(zip(inputs, emitted)):
        if inp.rows[0].logprobs is not None:
            spans.append((i, len(rows), len(em)))
            rows.extend(range(offset, offset + len(em)))
            tokens.extend(em)
        offset += len(inp.rows)
    if not spans:
        return logprobs, top, ranks
    dev = raw.device
    lp = torch.log_softmax(raw[to_device(rows, dev, torch.int64)], dim=-1)
    tok = to_device(tokens, dev, torch.int64)
    chosen = lp.gather(1, tok[:, None])
    parts = [chosen.squeeze(1).double(), (lp > chosen).sum(-1).double()]  # logprob, tokens more likely
    by_n: dict[int, list[tuple[int, int, int]]] = {}  # one topk per distinct n (ties keep their order)
    for i, lo, m in spans:
        n = inputs[i].rows[0].logprobs
        if n > 0:
            by_n.setdefault(min(n, lp.shape[-1]), []).append((i, lo, m))
    for n, group in by_n.items():
        sel = to_device([lo + j for _, lo, m in group for j in range(m)], dev, torch.int64)
        vals, ids = torch.topk(lp[sel], n, dim=-1)
        parts += [vals.double().reshape(-1), ids.double().reshape(-1)]
    host = torch.cat(parts).cpu().tolist()
    for i, lo, m in spans:
        logprobs[i] = host[lo : lo + m]
        ranks[i] = [int(c) + 1 for c in host[len(rows) + lo : len(rows) + lo + m]]
        top[i] = [{} for _ in range(m)]
    at = 2 * len(rows)
    for n, group in by_n.items():
        count = sum(m for _, _, m in group) * n
        vals, ids = host[at : at + count], host[at + count : at + 2 * count]
        at += 2 * count
        r = 0
        for i, _, m in group:
            top[i] = [
                dict(
                    zip(
                        (int(t) for t in ids[(r + j) * n : (r + j + 1) * n]),
                        vals[(r + j) * n : (r + j + 1) * n],
                    )
                )
                for j in range(m)
            ]
            r += m
    return logprobs, top, ranks


class SpecDecoder:
    """The engine's speculative-decoding state: drafts per sequence, the varlen rule, statistics."""

    def __init__(self, nextn: int, drafter: Drafter, curve: StepTimeCurve | None = None) -> None:
        if nextn < 1:
            raise ValueError(f"nextn must be >= 1 when speculative decoding is on, got {nextn}")
        self.nextn = nextn
        self.drafter = drafter
        self.state = SpecDecodeState(nextn)
        self.rule = ConfidenceScheduler(nextn, curve)
        # with a step-time curve (MTP varlen on) the policy also decides who drafts at all; it times the
        # steps it plans on the wall clock (read through this module's `time`, as every engine timing)
        self.policy = (
            DraftPolicy(
                nextn, self.rule, probe_budget=probe_budget_from_env(), clock=lambda: time.perf_counter()
            )
            if self.rule.enabled
            else None
        )
        # coupled by default: seeded tokens do not depend on which steps verify drafts
        self.verifier = DraftVerifier(sampling=sampled_verify_from_env())
        self.stats = SpecStats(nextn)
        self.draft_s = 0.0
        self.async_steps = 0  # plain steps run in the asynchronous loop (`spec_async_step.py`)

    @property
    def varlen(self) -> bool:
        return self.rule.enabled

    def add(self, seq_id: int, seed: int) -> None:
        self.state.add(seq_id, seed)

    def remove(self, seq_id: int) -> None:
        self.state.remove(seq_id)
        if self.policy is not None:
            self.policy.remove(seq_id)

    def discard(self, seq_id: int) -> None:
        """Preempted: its drafts and acceptance history are void (it recomputes from its tokens)."""
        if seq_id in self.state:
            self.state.discard(seq_id)
        if self.policy is not None:
            self.policy.remove(seq_id)

    def pending(self, seq_id: int, k: int) -> tuple[list[int], torch.Tensor | None, list[float]]:
        """The k drafts the scheduler fed for seq_id, their q rows and confidences."""
        plan = VerifyPlan(num_verify=[k], expected_tokens=0.0, predicted_ms=None)
        tokens, probs, confs = self.state.pack([seq_id], plan)
        return tokens.tolist(), probs, confs

    def commit(self, seq_ids: list[int], result: VerifyResult, decode: list[bool], confs: list[float]):
        """Consume the verified drafts; record statistics over decode sequences. Returns Rollbacks."""
        self.state.mark_scheduled(seq_ids)  # synchronous loop: scheduled and processed together
        if self.policy is not None:
            for seq_id, k, a in zip(seq_ids, result.num_drafts, result.num_accepted):
                drafted = self.state.pending(seq_id)[1]  # the confidences of all it drafted, k verified
                self.policy.record(seq_id, drafted, k, a)
            self.policy.calibrate_budget()  # (after a drafted step: outside any plan)
        rollbacks = self.state.commit(seq_ids, result)
        ks = [k for k, d in zip(result.num_drafts, decode) if d]
        accepted = [a for a, d in zip(result.num_accepted, decode) if d]
        if ks:
            self.stats.record_step(ks, accepted, confs, result.accept_probs.tolist())
        return rollbacks

    def record_plain(self, num_decode: int) -> None:
        """A step in which no sequence verified drafts: its decode sequences count as request-steps
        with none verified, as a verification step with k = 0 everywhere counts them."""
        if num_decode:
            self.stats.record_step([0] * num_decode, [0] * num_decode)

    @property
    def counts_draft_forwards(self) -> bool:
        """The drafter tells how many draft-block forwards a `propose` will run (`draft_forwards`)."""
        return hasattr(self.drafter, "draft_forwards")

    def draft_forwards(self, requests: list[DraftRequest]) -> int:
        """Draft-block forwards the drafter runs for `requests` (0 without requests): pass the ones that
        draft (`choose_drafting`)."""
        return self.drafter.draft_forwards(requests) if requests else 0

    def choose_drafting(self, candidates: list[tuple[int, int]], num_seqs: int | None = None) -> list[bool]:
        """Per candidate (seq_id, drafts it may propose): whether it drafts after this step. The draft
        policy's pick (it advances the policy's state: once per step), all of them without a policy.
        `num_seqs`: the sequences the next step decodes (default: the candidates). Asked before any
        `DraftRequest` is built, so that the ones it skips cost nothing."""
        if not candidates or self.policy is None:
            return [True] * len(candidates)
        num_seqs = len(candidates) if num_seqs is None else num_seqs
        return self.policy.plan(candidates, num_seqs).draft

    def propose(self, requests: list[DraftRequest], num_seqs: int | None = None) -> dict[int, list[int]]:
        """Run the drafter on `requests` (with the draft policy: the ones `choose_drafting` picked this
        step), store its drafts, choose how many each sequence verifies next step. `num_seqs`: the
        sequences the next step decodes (default: the requests). Returns {seq_id: drafts to feed}
        (possibly empty lists)."""
        if not requests:
            return {}
        num_seqs = len(requests) if num_seqs is None else num_seqs
        t0 = time.perf_counter()
        drafts = self.drafter.propose(requests)
        dt = time.perf_counter() - t0
        self.draft_s += dt
        ids = [r.seq_id for r in requests]
        for seq_id, d in zip(ids, drafts):
            self.state.propose(seq_id, d.tokens, d.confidences, d.probs)
        if self.policy is not None:
            self.policy.record_draft_time(len(requests), dt * 1e3)
            counts = self.policy.verify_counts(ids, [d.confidences for d in drafts], num_seqs)
        else:
            counts = self.rule.choose(self.state.varlen_inputs(ids)).num_verify
        return {seq_id: list(d.tokens[:k]) for seq_id, d, k in zip(ids, drafts, counts)}

    def update_runtime(
        self, num_tokens: int, forward_s: float, num_seqs: int, sample_s: float, num_rows: int, verified: bool
    ) -> None:
        """A measured decode step: `num_rows` logits rows sampled (`verified`: through verification). A step
        larger than the step-time curve's largest size (more sequences than the curve was measured for)
        is left out of the varlen rule's feedback: the curve cannot charge it."""
        if self.varlen and num_seqs and num_tokens <= self.rule.curve.max_tokens:
            self.rule.update_runtime(num_tokens, forward_s * 1e3, num_seqs, sample_s * 1e3)
        if self.policy is not None and num_rows:
            self.policy.record_step_time(num_rows, sample_s * 1e3, verified)

    def untimed_step(self) -> None:
        """The step just run had prefill in it: the draft policy does not take its wall time as a decode
        step's."""
        if self.policy is not None:
            self.policy.untimed_step()

    def record_host_time(self, num_rows: int, host_s: float, verified: bool) -> None:
        """A measured decode step's host work outside its forward, sampler (or verification) and draft
        forward, over its `num_rows` rows (`verified`: a step that verified drafts): what the draft
        policy charges a verification step beyond a plain one."""
        if self.policy is not None and num_rows:
            self.policy.record_host_time(num_rows, host_s * 1e3, verified)

    def summary(self) -> dict:
        out = self.stats.summary()
        out["nextn"] = self.nextn
        out["varlen"] = self.varlen
        out["draft_s"] = self.draft_s
        out["async_steps"] = self.async_steps
        if self.policy is not None:
            out.update(self.policy.summary())
        return out
