"""The asynchronous loop's model thread: steps run in submission order, and a step that takes its
unknown input ids from the step before is launched before that step's tokens are read back.

Why: with one plain worker thread, step N+1 could start only once N's tokens had reached the host
(its unknown input ids are those tokens), so the device sat idle for the host time between N's last
kernel and N+1's first: reading N's tokens back, building N+1's metadata and launching it. Here the
thread launches N (forward and sampling enqueued, `ModelWorker.launch`), and when the next job is a
step with `chain=True` while N is still running on the device, it launches that one too, its inputs
read on the device from N's sampled tokens, and only then reads N's tokens back
(`ModelWorker.finish`) and resolves N's future. The device runs N+1 right behind N while the host
reads N, commits it and schedules N+2. When N has already finished (a host-bound step, or the CPU,
where the device is the host), N is finished first and N+1 filled on the host: the engine then gets
N's result as early as possible, and its commit and scheduling overlap N+1's launch.

A launched step is finished when the next job arrives (any job: a plain one, e.g. a data-parallel
idle forward, runs only after every earlier step has finished) or when the engine waits for its
result and nothing was submitted after it (`StepFuture.result` then asks for it). Results, errors
and their order are exactly those of running every job to completion one after the other.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from .step_io import StepInput
from .worker import ModelWorker, PendingStep

_FLUSH = object()  # finish the launched step: the engine waits for it and nothing follows it
_STOP = object()


class StepFuture(Future):
    """A step's result; `result()` first has the pipeline finish the step if it is the last job
    submitted (otherwise the next job's arrival finishes it)."""

    def __init__(self, pipeline: StepPipeline, index: int) -> None:
        super().__init__()
        self._pipeline, self._index = pipeline, index

    def result(self, timeout: float | None = None):
        if not self.done():
            self._pipeline._flush_if_last(self._index)
        return super().result(timeout)


class StepPipeline:
    """Submit steps (`submit_step`) and plain jobs (`submit`) from one thread (the engine's); they run
    on one model thread in that order."""

    def __init__(
        self, worker: ModelWorker, initializer: Callable | None = None, initargs: tuple = ()
    ) -> None:
        self.worker = worker
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._submitted = 0  # jobs submitted so far (the last one's index is _submitted - 1)
        self._flushed = -1  # the last index a flush was asked for
        self._lock = threading.Lock()
        self.chained_launches = 0  # steps launched before the step ahead of them was finished
        # chain every chainable step, finished on the device or not (tests: the device-fed path on the CPU)
        self.always_chain = False
        self._thread = threading.Thread(
            target=self._loop, args=(initializer, initargs), name="deepinfer-model", daemon=True
        )
        self._thread.start()

    def submit_step(self, step: StepInput, chain: bool = False) -> StepFuture:
        """`worker.run(step)` as launch + finish. chain: the step's unknown input ids are the tokens of
        the step submitted just before it (its `prev_rows` say which), so it may be launched before that
        step is finished."""
        future = self._new_future()
        self._jobs.put(("step", future, step, chain))
        return future

    def submit(self, fn: Callable, *args) -> StepFuture:
        """`fn(*args)` on the model thread once every earlier job has finished."""
        future = self._new_future()
        self._jobs.put(("call", future, fn, args))
        return future

    def shutdown(self, wait: bool = True) -> None:
        self._jobs.put(_STOP)
        if wait:
            self._thread.join()

    def _new_future(self) -> StepFuture:
        with self._lock:
            future = StepFuture(self, self._submitted)
            self._submitted += 1
        return future

    def _flush_if_last(self, index: int) -> None:
        with self._lock:
            if index == self._submitted - 1 and self._flushed < index:
                self._flushed = index
                self._jobs.put(_FLUSH)

    # ---------------------------------------------------------------------------------- model thread
    def _loop(self, initializer: Callable | None, initargs: tuple) -> None:
        if initializer is not None:
            initializer(*initargs)
        pending: tuple[Future, PendingStep] | None = None  # launched, not finished
        while True:
            t0 = time.perf_counter()
            job = self._jobs.get()
            if pending is not None:  # (its sampling time excludes the wait for work)
                pending[1].waited_s += time.perf_counter() - t0
            if job is _FLUSH or job is _STOP:
                pending = self._finish(pending)
                if job is _STOP:
                    return
                continue
            kind, future = job[0], job[1]
            if kind == "call":
                pending = self._finish(pending)
                _run(future, job[2], *job[3])
                continue
            step, chain = job[2], job[3]
            chained = (
                chain
                and pending is not None
                and self.worker.feeds_device_inputs
                and (self.always_chain or not pending[1].complete())
            )
            if not chained:
                pending = self._finish(pending)
            try:
                launched = self.worker.launch(step, prev=pending[1] if chained else None)
            except BaseException as e:  # noqa: BLE001 - handed to the engine through the future
                pending = self._finish(pending)
                future.set_exception(e)
                continue
            self.chained_launches += int(chained)
            self._finish(pending)
            pending = (future, launched)

    def _finish(self, pending: tuple[Future, PendingStep] | None) -> None:
        if pending is not None:
            _run(pending[0], self.worker.finish, pending[1])
        return None


def _run(future: Future, fn: Callable, *args) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to the engine through the future
        future.set_exception(e)
