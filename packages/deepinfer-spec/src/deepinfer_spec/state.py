"""Per-request draft bookkeeping between the drafter, the varlen rule, the verifier and the caches.

Life of a request's drafts (spec §6.3): the drafter proposes n drafts with confidences after a step
(`propose`); the scheduler decides how many to verify (`varlen_inputs` -> `ConfidenceScheduler.choose`);
the engine feeds `[g, d1..dk]` and the verifier accepts a prefix (`pack` -> `DraftVerifier.verify`);
`commit` consumes the drafts and says which KV rows to keep and which to roll back.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from .random_stream import DRAFT_SEED_OFFSET
from .row_blocks import cat_rows
from .varlen import VarlenRequest, VerifyPlan
from .verify import VerifyResult


def cumulative_rates(confidences: Sequence[float]) -> list[float]:
    """Estimated probability that the first j drafts are all accepted: running product of confidences."""
    out, running = [], 1.0
    for c in confidences:
        running *= float(c)
        out.append(running)
    return out


@dataclass
class Rollback:
    """What a verification step leaves in the caches of one request.

    The step wrote KV / state for 1 + num_verified rows `[g, d1..dk]` at positions P .. P+k. Rows
    0 .. num_accepted (g and the accepted drafts) are kept, so num_cached becomes P + 1 + num_accepted;
    the rest (`num_discarded` rows, draft tokens `discarded_tokens`) must leave no trace.
    """

    seq_id: Hashable
    num_verified: int
    num_accepted: int
    emitted: list[int]
    discarded_tokens: list[int]

    @property
    def num_rows_written(self) -> int:
        return 1 + self.num_verified

    @property
    def num_rows_kept(self) -> int:
        return 1 + self.num_accepted

    @property
    def num_discarded(self) -> int:
        return self.num_verified - self.num_accepted


@dataclass
class _Request:
    seed: int
    drafts: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    accept_rates: list[float] = field(default_factory=list)
    prev_accept_rates: list[float] = field(default_factory=list)
    has_draft_info: bool = False
    schedule_cnt: int = 0
    process_cnt: int = 0


class SpecDecodeState:
    def __init__(self, nextn: int) -> None:
        if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
            raise ValueError(f"nextn must be an integer >= 0, got {nextn!r}")
        self.nextn = nextn
        self._requests: dict[Hashable, _Request] = {}

    # -- membership ------------------------------------------------------------------------------
    def add(self, seq_id: Hashable, seed: int = 0) -> None:
        if seq_id in self._requests:
            raise ValueError(f"seq_id {seq_id!r} is already tracked")
        self._requests[seq_id] = _Request(seed=int(seed))

    def remove(self, seq_id: Hashable) -> None:
        self._requests.pop(seq_id, None)

    def discard(self, seq_id: Hashable) -> None:
        """Forget a request's drafts and history, e.g. when it is preempted and will be recomputed:
        it restarts like a fresh request (no drafts until the drafter proposes again)."""
        seed = self._get(seq_id).seed
        self._requests[seq_id] = _Request(seed=seed)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._requests

    def _get(self, seq_id: Hashable) -> _Request:
        try:
            return self._requests[seq_id]
        except KeyError:
            raise ValueError(f"seq_id {seq_id!r} is not tracked (add it first)") from None

    def draft_seed(self, seq_id: Hashable) -> int:
        """Seed of the request's draft-sampling stream (target seed + the reference's offset)."""
        return self._get(seq_id).seed + DRAFT_SEED_OFFSET

    # -- drafter side ----------------------------------------------------------------------------
    def propose(
        self,
        seq_id: Hashable,
        drafts: Sequence[int],
        confidences: Sequence[float],
        draft_probs: torch.Tensor | None = None,
        stop_emitted: bool = False,
    ) -> None:
        """Record the drafter's output after a step. A request that just emitted a stop token gets
        confidences 0 (the reference's rule), so the varlen rule will not spend verification on it."""
        req = self._get(seq_id)
        drafts = [int(t) for t in drafts]
        confidences = [float(c) for c in confidences]
        if len(drafts) > self.nextn:
            raise ValueError(f"drafts must have at most nextn={self.nextn} tokens, got {len(drafts)}")
        if len(confidences) != len(drafts):
            raise ValueError(
                f"confidences must have one value per draft ({len(drafts)}), got {len(confidences)}"
            )
        if any(not (0.0 <= c <= 1.0) for c in confidences):
            raise ValueError(f"confidences must lie in [0, 1], got {confidences}")
        if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] != len(drafts)):
            raise ValueError(
                f"draft_probs must be [len(drafts)={len(drafts)}, vocab], got {tuple(draft_probs.shape)}"
            )
        if stop_emitted:
            confidences = [0.0] * len(confidences)
        req.drafts, req.confidences, req.draft_probs = drafts, confidences, draft_probs
        req.prev_accept_rates = req.accept_rates
        req.accept_rates = cumulative_rates(confidences)
        if req.prev_accept_rates and len(req.prev_accept_rates) != len(drafts):
            req.prev_accept_rates = []  # a different draft length: no comparable history
        req.has_draft_info = True

    # -- scheduler side --------------------------------------------------------------------------
    def varlen_inputs(self, seq_ids: Sequence[Hashable]) -> list[VarlenRequest]:
        out = []
        for seq_id in seq_ids:
            req = self._get(seq_id)
            out.append(
                VarlenRequest(
                    num_drafts=len(req.drafts),
                    accept_rates=list(req.accept_rates),
                    prev_accept_rates=list(req.prev_accept_rates),
                    schedule_cnt=req.schedule_cnt,
                    process_cnt=req.process_cnt,
                    has_draft_info=req.has_draft_info,
                )
            )
        return out

    def mark_scheduled(self, seq_ids: Sequence[Hashable]) -> None:
        for seq_id in seq_ids:
            self._get(seq_id).schedule_cnt += 1

    def pending(self, seq_id: Hashable) -> tuple[list[int], list[float]]:
        req = self._get(seq_id)
        return list(req.drafts), list(req.confidences)

    def pack(
        self, seq_ids: Sequence[Hashable], plan: VerifyPlan
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[float]]:
        """Packed inputs for the verifier: draft tokens [Σ k] (host), draft probs [Σ k, V] (None if no
        request stored them; on the device of the stored rows), and the confidences of the verified
        drafts (for the statistics)."""
        if len(seq_ids) != len(plan.num_verify):
            raise ValueError(
                f"plan.num_verify must have one entry per seq_id ({len(seq_ids)}), got {len(plan.num_verify)}"
            )
        tokens, probs, confs = [], [], []
        for seq_id, k in zip(seq_ids, plan.num_verify):
            req = self._get(seq_id)
            if not 0 <= k <= len(req.drafts):
                raise ValueError(f"plan.num_verify for {seq_id!r} must be in [0, {len(req.drafts)}], got {k}")
            tokens.extend(req.drafts[:k])
            confs.extend(req.confidences[:k])
            if k:
                probs.append((k, req.draft_probs[:k] if req.draft_probs is not None else None))
        draft_probs = None
        stored = [p for _, p in probs if p is not None]
        if stored:
            # Requests that kept no distribution (greedy ones need none) get zero rows; the verifier
            # rejects the draft of a zero row of a sampled request.
            zeros = stored[0].new_zeros
            draft_probs = cat_rows([p if p is not None else zeros(k, stored[0].shape[1]) for k, p in probs])
        # Draft ids are host bookkeeping (the verifier validates them on the host and sends them to the
        # device with its other indices); the q rows stay where the drafter made them.
        return torch.tensor(tokens, dtype=torch.int64, device="cpu"), draft_probs, confs

    # -- after verification ----------------------------------------------------------------------
    def commit(self, seq_ids: Sequence[Hashable], result: VerifyResult) -> list[Rollback]:
        """Consume the verified drafts; returns per request what to keep and what to roll back."""
        if len(seq_ids) != len(result.num_drafts):
            raise ValueError(
                f"result must have one entry per seq_id ({len(seq_ids)}), got {len(result.num_drafts)}"
            )
        out = []
        for seq_id, k, a, emitted in zip(seq_ids, result.num_drafts, result.num_accepted, result.emitted):
            req = self._get(seq_id)
            if k > len(req.drafts):
                raise ValueError(
                    f"result verified {k} drafts for {seq_id!r} but only {len(req.drafts)} are pending"
                )
            out.append(Rollback(seq_id, k, a, list(emitted), req.drafts[a:k]))
            req.drafts, req.confidences, req.draft_probs = [], [], None
            req.process_cnt += 1
        return out
