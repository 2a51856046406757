"""How the engine runs one step: the interface every loop implements, and the synchronous loop.

A strategy owns one way of turning the scheduler's plan into committed tokens; `LLMEngine.step` calls
`step()` and returns what finished. The loops (this file's `SyncStep`, `async_step.AsyncStep`,
`spec_step.SpecStep`, `spec_async_step.SpecAsyncStep`) share the parts in `StepContext` and emit the
same tokens: the sampler's draw depends only on (seed, position) and a runner's logits only on the
sequence.

A step that raises (building it, the forward, sampling, committing, detokenizing, a grammar) fails the
requests it carries, as an abort with the error would, and is closed in the scheduler with no tokens:
the engine, its scheduler and the block accounting stay consistent and the next step runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import scheduling
from .output_processor import OutputProcessor
from .request_table import RequestTable
from .stats import EngineStats
from .step_builder import StepBuilder
from .step_io import StepInput, StepResult
from .tier_transfers import TierLoadError
from .worker import ModelWorker

if TYPE_CHECKING:
    from deepinfer_sched import Scheduler

    from .dp_rank import DataParallelRank
    from .tier_transfers import TierTransfers

logger = logging.getLogger("deepinfer")


@dataclass
class StepContext:
    """The engine's parts a step strategy works with."""

    scheduler: Scheduler
    worker: ModelWorker
    table: RequestTable
    builder: StepBuilder
    output: OutputProcessor
    stats: EngineStats
    dp: DataParallelRank | None = None
    tier: TierTransfers | None = None  # the KV tier below the device prefix cache


class StepStrategy:
    """One engine step. `busy`: steps launched and not yet committed; `settle`: commit them now (an
    abort of everything); `close`: stop whatever the strategy started (threads)."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.scheduler, self.worker, self.table = ctx.scheduler, ctx.worker, ctx.table
        self.builder, self.output, self.stats, self.dp = ctx.builder, ctx.output, ctx.stats, ctx.dp
        self.tier = ctx.tier

    def step(self) -> None:
        raise NotImplementedError

    def busy(self) -> bool:
        return False

    def settle(self) -> None:
        """Commit every step in flight (none in a loop that finishes each step before returning)."""

    def close(self) -> None:
        """Wait for what is in flight and stop what the strategy started (nothing here)."""

    # ------------------------------------------------------------------ shared by the loops
    def _schedule(self) -> tuple[object, float]:
        t0 = time.perf_counter()
        if self.tier is not None:
            self.tier.refresh()
        out = scheduling.schedule(self.scheduler)
        dt = time.perf_counter() - t0
        self.stats.schedule_s += dt
        return out, dt

    def _has_transfers(self, out) -> bool:
        return self.tier is not None and out is not None and out.has_tier_transfers

    def _transfer(self, out) -> None:
        """The schedule's KV tier transfers (before its forward, with no step in flight: a block a
        preemption freed in this schedule may still be written by the step in flight)."""
        if self.tier is not None:
            self.tier.apply(out)

    def _redo_loads(self, out, exc: TierLoadError) -> None:
        """Loads failed: the sequences that hold a block that was not loaded (the loading one, and any
        admitted in the same schedule that shares the block) go back to waiting and recompute those
        blocks, their keys having left the tier; a reconcile drops them from the step, the others run
        on. Where the scheduler finishes preempted sequences instead (stop_preempted_request), their
        requests fail, naming the load."""
        lost = set(exc.blocks)
        seq_ids = scheduling.seq_ids(out).tolist()
        hit = [s for s in seq_ids if lost.intersection(scheduling.block_table(self.scheduler, s))]
        message = f"kv tier failed: {type(exc).__name__}: {exc}"
        failed = [s for s in hit if not scheduling.requeue(self.scheduler, out, s)]
        logger.warning(
            "%s; %d sequence(s) recompute the blocks, %d fail", message, len(hit) - len(failed), len(failed)
        )
        for seq_id in failed:
            self.table.fail_seq(seq_id, message)

    def _transfer_sync(self, out):
        """`_transfer` for the loops that finish each step before the next: returns what is left of the
        step to run, or None when a failed load left nothing of it (the step is then closed, and with
        data parallelism an idle forward joins the other ranks' collectives)."""
        try:
            self._transfer(out)
            return out
        except TierLoadError as e:
            self._redo_loads(out, e)
        out = self.scheduler.reconcile(out)  # (always: the sequences sent back must leave the step)
        if not scheduling.is_empty(out):
            return out
        self._retire(out)
        if self.dp is not None:
            self.worker.idle()
        self.table.collect_all()
        return None

    def _build(self, out, fill_from_previous: bool = False) -> StepInput:
        step = self.builder.step(out, fill_from_previous)
        self.stats.prefill_flops += self.builder.prefill_flops(out, step.batch)
        return step

    def _idle(self, out) -> None:
        """The schedule is empty: close it, let finished requests go."""
        self._retire(out)
        self.table.release_idle(self.busy())

    def _fail_step(self, out, stage: str, exc: Exception) -> StepResult:
        """`stage` raised for the step `out`: every request with a sequence in it fails now (its sequences
        are aborted, so no step scheduled after this one carries them); returns the step's result, no
        token and an error per row, whose commit closes the step in the scheduler."""
        message = f"{stage} failed: {type(exc).__name__}: {exc}"
        logger.warning("%s; the step's requests fail, the engine goes on", message, exc_info=exc)
        ids = scheduling.seq_ids(out).tolist()
        for seq_id in ids:
            self.table.fail_seq(seq_id, message)
        n = len(ids)
        return StepResult(
            tokens=np.full(n, -1, dtype=np.int64),
            logprobs=[None] * n,
            top=[None] * n,
            ranks=[None] * n,
            errors=dict.fromkeys(range(n), message),
        )

    def _recover(self, out, stage: str, exc: Exception, forward_ran: bool) -> None:
        """A loop that finishes each step before the next is scheduled: fail the step's requests, close
        the step in the scheduler if it is still open, and (data parallel) join the other ranks'
        collectives with an idle forward if this rank's forward never ran."""
        self._fail_step(out, stage, exc)
        if self.scheduler.num_inflight_steps:
            scheduling.close_failed(self.scheduler, out)
            self.table.release_pending()
        if self.dp is not None and not forward_ran:
            self.worker.idle()
        self.table.collect_all()

    def _retire(self, out) -> None:
        """Close an empty schedule; the sequences it finished (preempted ones) end now."""
        self.output.settle_finished(scheduling.retire(self.scheduler, out))

    def _vote(self, launching: int = 0, inline: bool = True, submit_idle=None) -> None:
        """Data parallel: the step's vote with the other ranks (DataParallelRank.agree). Exactly one
        per step() on every rank, before anything waits for a forward. `launching`: forwards this
        step runs inline after the vote; idle forwards to catch up with the other ranks run inline,
        or are queued behind the launched ones by `submit_idle() -> Future`."""
        if self.dp is None:
            return
        self.dp.agree(
            busy=bool(self.table.requests) or self.busy(),
            launching=launching,
            idle_inline=inline,
            run_idle=self.worker.idle,
            submit_idle=submit_idle,
        )


class SyncStep(StepStrategy):
    """Schedule, run the model, commit and emit: each step finishes before `step()` returns."""

    def step(self) -> None:
        out, _ = self._schedule()
        self._vote(launching=0 if scheduling.is_empty(out) else 1)
        if scheduling.is_empty(out):
            self._idle(out)
            return
        stage, forward_ran = "kv tier", False
        try:
            out = self._transfer_sync(out)
            if out is None:
                return
            stage = "prepare"
            t0 = time.perf_counter()
            step = self._build(out)
            self.stats.prepare_s += time.perf_counter() - t0
            stage, forward_ran = "model step", True
            result = self.worker.run(step)
            stage = "output processing"
            t0 = time.perf_counter()
            finished = self.output.commit(out, result)
            self.output.emit(out, result, finished)
            self.stats.process_s += time.perf_counter() - t0
            self.table.collect_all()
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            self._recover(out, stage, e, forward_ran)
