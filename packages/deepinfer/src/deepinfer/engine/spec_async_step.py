"""A drafting engine whose plain steps stay in the asynchronous loop (drafts on, draft policy on).

The draft policy (`deepinfer_spec.DraftPolicy`, MTP varlen) makes most steps plain once a drafter proves
unhelpful: its sequences back off and probe now and then within the probe budget. `SpecStep` runs every
step synchronously, so such an engine would pay the synchronous loop's host gap between steps although
nobody drafts. This strategy runs those steps in `AsyncStep`'s loop and switches to `SpecStep` only
around drafts:

* While the plan after the step in flight would let nobody draft (`DraftPolicy.would_draft` over the
  sequences that may emit in it is False: everyone backed off, no probe due or the due ones held back
  by the probe budget), the next plain step is scheduled and launched behind it, and once the step is
  emitted the policy `advance`s as that plan would have (plan counter, probe budget, skipped steps).
* Otherwise the step in flight is drained (committed and emitted, nothing launched behind it) and the
  drafter proposes after it as `SpecStep` proposes after a plain step: the runner's last executed step
  is that one, so the paged drafter reads its keys. The drafted steps then run synchronously in
  `SpecStep` until a plan lets nobody draft (no drafts fed to the scheduler); the loop goes back to
  plain steps ahead from there, with nothing in flight.

The scheduler is built with no drafts assumed ahead (`num_speculative_tokens=0`, `LLMEngine`): a step
scheduled behind one in flight is plain, and the drafted steps, scheduled with nothing in flight, take
the drafts set on their sequences. Tokens are those of `SpecStep` and of drafts off (greedy, and seeded
sampled under coupled verification): every step draws each token with the plain sampler's stream at
its position, in whichever loop it runs. Plain steps feed their measured times to the varlen rule and
the policy's cost model in either loop (the worker times a step's launch and its read-back alike; a
device-bound step's read-back waits for its device work, launched ahead or not).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import envs
from . import scheduling
from .async_step import AsyncStep
from .spec_decode import SpecDecoder
from .spec_step import SpecStep
from .step_io import StepResult
from .step_strategy import StepContext, StepStrategy


def runs_plain_steps_ahead(nextn: int, use_async: bool, data_parallel: bool) -> bool:
    """Whether an engine runs `SpecAsyncStep`: drafts on with the draft policy (MTP varlen: without it
    everyone drafts every step), the asynchronous loop asked for, one process (data-parallel ranks vote
    on every step's draft forwards, which `SpecStep` runs)."""
    return nextn > 0 and bool(envs.DEEPINFER_ENABLE_MTP_VARLEN) and use_async and not data_parallel


class SpecAsyncStep(StepStrategy):
    def __init__(self, ctx: StepContext, spec: SpecDecoder, device: torch.device) -> None:
        super().__init__(ctx)
        if spec.policy is None or ctx.dp is not None:
            raise ValueError("SpecAsyncStep needs the draft policy (MTP varlen) and no data parallelism")
        self.spec = spec
        self.drafted = SpecStep(ctx, spec)
        self.plain = _PlainStepsAhead(ctx, device, self)
        self._drafts_fed = False  # the last plan set drafts: the next step verifies them (synchronously)

    @property
    def pipeline(self):
        """The asynchronous loop's model thread (`LLMEngine.pipeline`)."""
        return self.plain.pipeline

    def step(self) -> None:
        if self._drafts_fed and not self.plain.busy():
            self.drafted.step()
            self._drafts_fed = scheduling.has_draft_tokens(self.scheduler)
        else:
            self.plain.step()

    def busy(self) -> bool:
        return self.plain.busy()

    def settle(self) -> None:
        self.plain.settle()

    def close(self) -> None:
        self.plain.close()

    # ------------------------------------------------------------------ the plain steps' hooks
    def keep_ahead(self, out) -> bool:
        """Step `out` runs: may a plain step be launched behind it? Only if the plan after it lets nobody
        draft, asked of the sequences that may emit in it and go on drafting (a superset of the
        candidates of that plan: some may finish in it)."""
        ids, going_on = [], 0
        rows = scheduling.seq_ids(out).tolist()
        for seq_id, emits in zip(rows, scheduling.emits_tokens(out).tolist()):
            seq = self.table.seqs.get(seq_id)
            if not emits or seq is None or seq.finished:
                continue
            going_on += 1
            if self.drafted.drafts_that_fit(seq, emitting=1) >= 1:  # after this step's token
                ids.append(seq_id)
        return not ids or not self.spec.policy.would_draft(ids, going_on)

    def plain_done(self, out, result: StepResult, finished: dict[int, str], preempted: set[int]) -> None:
        """A plain step ran in the asynchronous loop and is emitted: the request-steps it counts and the
        policy's plan after it, made now when the loop drained it (the drafter proposes), else advanced
        as a plan that lets nobody draft."""
        ids = scheduling.seq_ids(out).tolist()
        emitted = [
            i
            for i in range(len(ids))
            if result.tokens[i] >= 0 and i not in result.errors and ids[i] not in preempted
        ]
        self.drafted.record_plain_step(out, result, emitted)
        self.spec.async_steps += 1
        if not self.plain.busy():  # drained: nothing runs behind it, the runner's last step is this one
            ends = np.asarray(out.start_positions) + np.asarray(out.query_lens)
            self.drafted._propose_drafts(ids, {i: (int(ends[i]), 0) for i in emitted}, finished)
            self._drafts_fed = scheduling.has_draft_tokens(self.scheduler)
            return
        candidates, going_on = self.drafted.draft_candidates(ids, set(emitted), finished)
        if candidates:  # (as `SpecDecoder.propose` plans only when someone may draft)
            self.spec.policy.advance([seq.seq_id for _, seq, _ in candidates], going_on)


class _PlainStepsAhead(AsyncStep):
    """`AsyncStep` whose next step is launched only while the hybrid loop says so, and which tells it
    of each emitted step; a sequence a schedule preempts loses its draft state, as in `SpecStep`."""

    def __init__(self, ctx: StepContext, device: torch.device, loop: SpecAsyncStep) -> None:
        super().__init__(ctx, device)
        self.loop = loop

    def _schedule(self):
        out, dt = super()._schedule()
        for seq_id in scheduling.preempted(out):
            self.loop.spec.discard(seq_id)
        return out, dt

    def _keep_ahead(self, out) -> bool:
        return self.loop.keep_ahead(out)

    def _emitted(self, out, result, finished, preempted) -> None:
        self.loop.plain_done(out, result, finished, preempted)
