"""The asynchronous ("zero-overhead") loop: the model runs on a worker thread, one step ahead.

While step N runs, the main thread schedules step N+1 (the scheduler assumes every running sequence
emits its token and marks the ids it cannot know as -1) and queues it behind N; the worker fills
those ids from the tokens it sampled in N (`prev_rows`), on the device: N+1 is launched before N's
tokens are read back (`step_pipeline.py`), so the device runs N+1 right behind N
(DEEPINFER_ASYNC_DEVICE_INPUTS=0: filled on the host once N is read). The host then commits N
(`update_from_output`) and detokenizes it while N+1 runs. Steps with structured-output rows, or rows
whose penalties / bad words read the seen tokens, instead wait for N, `reconcile`, and launch (their
grammar masks and processors need N's tokens).

`drain` commits and emits what is in flight and launches nothing: a loop built on this one
(`spec_async_step.py`) then runs its next step another way; `_keep_ahead` tells whether to schedule the
next step behind the one in flight.

A step that fails to build fails its requests at once and stays in line with a result of errors only,
so the scheduler still commits the steps in the order it scheduled them; a step whose model work
raised is committed the same way.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from . import scheduling
from .step_io import StepResult
from .step_pipeline import StepPipeline
from .step_strategy import StepContext, StepStrategy
from .tier_transfers import TierLoadError


@dataclass
class _InFlight:
    out: object  # the scheduler's output the step was built from
    future: Future  # its StepResult


class AsyncStep(StepStrategy):
    def __init__(self, ctx: StepContext, device: torch.device) -> None:
        super().__init__(ctx)
        self.pipeline: StepPipeline | None = StepPipeline(
            self.worker,
            # OpenMP thread counts and the current CUDA device are per thread: give the worker
            # the caller's (a DP rank's collectives run on this thread, on its own GPU).
            initializer=_init_worker_thread,
            initargs=(torch.get_num_threads(), device),
        )
        # Steps launched on the worker and not yet committed, oldest first (at most two: the one
        # running and the one queued behind it).
        self._inflight: deque[_InFlight] = deque()

    def busy(self) -> bool:
        return bool(self._inflight)

    def step(self) -> None:
        if not self._inflight:
            out, _ = self._schedule()
            if scheduling.is_empty(out):
                self._idle(out)
                self._vote_async()
                return
            self._launch_after_transfers(out)
            if not self._inflight:  # its tier loads failed and nothing of it was left to run
                self.table.release_idle(self.busy())
                self._vote_async()
                return
        head = self._inflight[0]
        if not self._keep_ahead(head.out):  # the next step runs another way: finish this one first
            self._vote_async()
            self.drain()
            return
        # Step N runs on the worker; schedule N+1 meanwhile.
        nxt, dt = self._schedule()
        if not head.future.done():
            self.stats.hidden_schedule_s += dt
        # A sequence preempted by this schedule while step N was in flight gets N's token dropped
        # by the scheduler (it will recompute it); the engine must drop it too.
        preempted = set(scheduling.preempted(nxt))
        if scheduling.is_empty(nxt):
            self._retire(nxt)
            nxt = None
        elif not self._needs_reconcile(nxt):
            # Queue N+1 behind N now: the worker fills its unknown input ids from N's tokens
            # (prev_rows), so the model never waits for the host.
            t0 = time.perf_counter()
            self._launch(nxt, fill_from_previous=True)
            dt = time.perf_counter() - t0
            self.stats.prepare_s += dt
            if not head.future.done():
                self.stats.hidden_prepare_s += dt
            nxt = None
        self._vote_async()  # before waiting: the other ranks join step N's all-to-alls only after it
        result = self._result(head)
        self._inflight.popleft()
        t0 = time.perf_counter()
        result, finished = self._commit(head.out, result, preempted)
        t1 = time.perf_counter()
        self._count_process(t1 - t0)
        if nxt is not None:  # structured rows / tier transfers: wait for N, then reconcile on the host
            if self._transfer_or_fail(nxt):
                nxt = scheduling.reconcile(self.scheduler, nxt)
            else:  # the sequences that failed or went back must leave the step, known inputs or not
                nxt = self.scheduler.reconcile(nxt)
            if scheduling.is_empty(nxt):
                self._retire(nxt)
            else:
                self._launch(nxt)
            self.stats.prepare_s += time.perf_counter() - t1
        # Detokenize N's tokens while N+1 runs.
        t0 = time.perf_counter()
        self._emit(head.out, result, finished, preempted)
        self._count_process(time.perf_counter() - t0)
        self.table.collect_all()

    def settle(self) -> None:
        while self._inflight:
            done = self._inflight.popleft()
            self.output.commit(done.out, self._result(done))

    def drain(self) -> None:
        """Commit and emit every step in flight and schedule none (`settle` only commits: an abort of
        everything): the loop can go on another way from here, nothing being in flight."""
        while self._inflight:
            done = self._inflight.popleft()
            t0 = time.perf_counter()
            result, finished = self._commit(done.out, self._result(done))
            self._emit(done.out, result, finished)
            self.stats.process_s += time.perf_counter() - t0
        self.table.collect_all()

    def _commit(self, out, result: StepResult, preempted: set[int] = frozenset()):
        """`output.commit`; the step's result and finished sequences (its requests fail if it raised)."""
        try:
            return result, self.output.commit(out, result, preempted)
        except Exception as e:  # noqa: BLE001 - (after the scheduler's commit) the step's requests fail
            return self._fail_step(out, "output processing", e), {}

    def _emit(self, out, result: StepResult, finished: dict[int, str], preempted: set[int] = frozenset()):
        try:
            self.output.emit(out, result, finished, preempted)
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            self._fail_step(out, "output processing", e)
        self._emitted(out, result, finished, preempted)

    # ------------------------------------------------------------------ for a loop built on this one
    def _keep_ahead(self, out) -> bool:
        """Whether to schedule the next step while the step `out` runs (else `drain`)."""
        return True

    def _emitted(self, out, result: StepResult, finished: dict[int, str], preempted: set[int]) -> None:
        """The step `out` is committed and emitted (`finished`: what its commit finished; `preempted`:
        sequences whose token the scheduler dropped)."""

    def _result(self, step: _InFlight) -> StepResult:
        """The step's result; a failure of its model work (launch, forward, sampling, read-back) fails
        the step's requests."""
        try:
            return step.future.result()
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            return self._fail_step(step.out, "model step", e)

    def close(self) -> None:
        while self._inflight:
            try:
                self._inflight.popleft().future.result()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        if self.pipeline is not None:
            self.pipeline.shutdown(wait=True)
            self.pipeline = None

    def _count_process(self, dt: float) -> None:
        self.stats.process_s += dt
        if self._inflight and not self._inflight[0].future.done():
            self.stats.hidden_process_s += dt

    def _needs_reconcile(self, out) -> bool:
        """Grammar masks and the logits processors that read the seen tokens (penalties, bad words)
        are built from the state after the previous step: such steps wait for it. So do steps with KV
        tier transfers (a block freed by this schedule may still be written by the step in flight)."""
        if self._has_transfers(out):
            return True
        seqs = self.table.seqs
        return any(
            (seq := seqs.get(seq_id)) is not None
            and (seq.grammar is not None or seq.request.reads_seen_tokens)
            for seq_id in scheduling.seq_ids(out).tolist()
        )

    def _transfer_or_fail(self, out) -> bool:
        """The schedule's tier transfers; False when some failed: the sequences that needed a failed load
        go back to recompute (`_redo_loads`; all of the step's requests fail if the transfers broke
        otherwise), and a reconcile then drops them from the step."""
        try:
            self._transfer(out)
            return True
        except TierLoadError as e:
            self._redo_loads(out, e)
            return False
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            self._fail_step(out, "kv tier", e)
            return False

    def _launch_after_transfers(self, out) -> None:
        """Nothing in flight: do the transfers, then launch (what a failure left of the step)."""
        if not self._has_transfers(out) or self._transfer_or_fail(out):
            self._launch(out)
            return
        out = self.scheduler.reconcile(out)
        if scheduling.is_empty(out):
            self._retire(out)
        else:
            self._launch(out)

    def _launch(self, out, fill_from_previous: bool = False) -> None:
        try:
            step = self._build(out, fill_from_previous)
        except Exception as e:  # noqa: BLE001 - its requests fail now; it is committed in its turn
            future = Future()
            future.set_result(self._fail_step(out, "prepare", e))
            self._inflight.append(_InFlight(out, future))
            return
        future = self.pipeline.submit_step(step, chain=fill_from_previous)
        self._inflight.append(_InFlight(out, future))
        if self.dp is not None:
            self.dp.launched += 1

    def _vote_async(self) -> None:
        """The vote; idle forwards queue on the worker thread behind the launched steps."""
        self._vote(inline=False, submit_idle=lambda: self.pipeline.submit(self.worker.idle))


def _init_worker_thread(num_threads: int, device: torch.device) -> None:
    torch.set_num_threads(num_threads)
    if device.type == "cuda" and device.index is not None:  # "cuda" alone: the current device
        torch.cuda.set_device(device)
