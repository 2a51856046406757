"""`AsyncLLM`: the engine behind an asyncio event loop, each request's outputs streaming as tokens arrive.

    async with AsyncLLM(model=None) as llm:
        async for out in llm.generate("Hello", SamplingParams(max_tokens=32, seq_seed=1)):
            print(out.outputs[0].text)  # cumulative; the last output has a finish_reason

One background task drives the engine. Between steps, on the event loop's thread, it admits the requests
added and aborts the ones cancelled since the last step; the step itself runs on one worker thread, so
the event loop (an HTTP server's, say) stays responsive while the model computes, and no engine state is
ever touched by two threads at once. A request's images are read and preprocessed (Pillow decoding,
resizing) on a third thread before the request is queued for admission (`ImageInputs.prepare`), so a
large or slow image delays its own request, never the steps of the others; admission then only runs the
vision tower. After each step every request with new tokens gets a snapshot
(`streaming.RequestStream`). Tokens are the engine's: a request with a `seq_seed` gets the same output as
from `LLM.generate`, whatever else runs beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .engine.images import check_takes_images
from .engine_args import EngineArgs
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .streaming import RequestStream, num_tokens, snapshot


class QueueFullError(RuntimeError):
    """The engine already holds `max_waiting_requests` requests that have not started; try later."""


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error (or the engine was closed); no request can complete."""


# How long the loop may wait, after a step in which requests finished, for their clients' next requests
# (`AsyncLLM._await_replacements`): this fraction of the last step's time.
REFILL_WAIT_FRACTION = 0.25

# Called after each delivery of new tokens and once a request finishes: (output so far, tokens new in
# it (0 for a finish without any), seconds since the previous delivery or None before the first,
# perf_counter time now).
DeliveryListener = Callable[[RequestOutput, int, "float | None", float], None]


@dataclass
class _Admission:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None: a text prompt with images, expanded at admission
    params: SamplingParams
    arrival_time: float
    admitted: asyncio.Future
    multi_modal_data: object = None  # `PreparedImages`, expanded by the engine when it admits the request


class AsyncLLM:
    """`AsyncLLM(model=None, max_waiting_requests=None, **engine_args)`, or `AsyncLLM.from_engine(engine)`.

    max_waiting_requests: how many requests may wait for their first token at once (None: no bound);
    one more raises `QueueFullError` from `add_request` / `generate`.
    """

    def __init__(
        self, model: str | None = None, *, max_waiting_requests: int | None = None, **kwargs
    ) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        args = EngineArgs(model=model, **kwargs)
        if args.disaggregation != "off":
            from .engine.disaggregated import DisaggregatedEngine

            engine = DisaggregatedEngine(args)
        elif args.world_size > 1:  # data / context / expert parallel: one engine per rank process
            from .engine.data_parallel import DataParallelEngine

            engine = DataParallelEngine(args)
        else:
            from .engine.llm_engine import LLMEngine

            engine = LLMEngine.from_engine_args(args)
        self._setup(engine, max_waiting_requests)

    @classmethod
    def from_engine(cls, engine, *, max_waiting_requests: int | None = None) -> AsyncLLM:
        """An `AsyncLLM` over an engine built by the caller; `close()` closes it."""
        llm = cls.__new__(cls)
        llm._setup(engine, max_waiting_requests)
        return llm

    def _setup(self, engine, max_waiting_requests: int | None) -> None:
        if max_waiting_requests is not None and (
            isinstance(max_waiting_requests, bool)
            or not isinstance(max_waiting_requests, int)
            or max_waiting_requests < 1
        ):
            raise ValueError(
                f"max_waiting_requests must be an integer >= 1 or None, got {max_waiting_requests!r}"
            )
        self.engine = engine
        # a data-parallel or disaggregated front: its ranks (its decode engine) report outputs so far
        if hasattr(engine, "stream_outputs"):
            engine.stream_outputs = True
        self.max_waiting_requests = max_waiting_requests
        self.listeners: list[DeliveryListener] = []
        self._streams: dict[str, RequestStream] = {}
        self._admissions: list[_Admission] = []
        self._aborts: set[str] = set()
        self._waiting: set[str] = set()  # added, no token yet
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-step")
        self._image_executor: ThreadPoolExecutor | None = None  # started by the first request with images
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._closed = False
        self.engine_stats: dict = {}
        self._refresh_stats()

    # ------------------------------------------------------------------ facts of the engine
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def tokenizer_config(self) -> dict:
        return self.engine.tokenizer_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_waiting(self) -> int:
        """Requests added that have no token yet (queued here, waiting in the scheduler or prefilling)."""
        return len(self._waiting)

    @property
    def num_queued(self) -> int:
        """Requests added that the loop has not handed to the engine yet."""
        return len(self._admissions)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._closed

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | dict | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        multi_modal_data: dict | None = None,
    ) -> RequestStream:
        """Admit one request and return its stream once the engine holds it. Raises ValueError (naming
        the problem) for a request the engine refuses, `QueueFullError` when too many wait already,
        `EngineDeadError` after the loop stopped. Nothing of a refused request stays behind.
        `multi_modal_data`: images, as `LLMEngine.add_request` takes them: read and preprocessed on the
        image thread first (the steps of other requests go on meanwhile), then expanded and encoded when
        the engine admits the request, between steps."""
        self._check_running()
        params = _params(sampling_params)
        if multi_modal_data is not None:
            check_takes_images(self.engine)
            ids = None if prompt_token_ids is None else list(prompt_token_ids)
        else:
            if prompt_token_ids is None:
                if prompt is None:
                    raise ValueError("either prompt or prompt_token_ids must be given")
                prompt_token_ids = self.engine.encode(prompt)
            ids = self.engine.validate_request(list(prompt_token_ids), params)
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.max_waiting_requests is not None and len(self._waiting) >= self.max_waiting_requests:
            raise QueueFullError(
                f"{len(self._waiting)} requests are waiting to start (max_waiting_requests="
                f"{self.max_waiting_requests}); retry later"
            )
        self._ensure_loop()
        arrival = time.perf_counter()
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._waiting.add(request_id)
        if multi_modal_data is not None:
            try:
                multi_modal_data = await self._prepare_images(multi_modal_data)
                self._check_running()  # the loop may have stopped while the images were prepared
            except BaseException:
                self._forget(request_id)
                raise
        admitted = asyncio.get_running_loop().create_future()
        self._admissions.append(
            _Admission(request_id, prompt, ids, params, arrival, admitted, multi_modal_data)
        )
        self._wake.set()
        try:
            await admitted
        except ValueError:  # refused by the engine: the loop has forgotten it already
            raise
        except BaseException:  # cancelled (queued or just admitted): nothing of it may stay behind
            self._forget(request_id)
            self._aborts.add(request_id)
            self._wake.set()
            raise
        return stream

    async def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | dict | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        multi_modal_data: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as tokens arrive (cumulative; the last one is finished). Leaving the
        loop early (break, cancellation, a closed client) aborts the request and frees its blocks."""
        stream = await self.add_request(
            prompt,
            sampling_params,
            request_id,
            prompt_token_ids=prompt_token_ids,
            multi_modal_data=multi_modal_data,
        )
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request before its next step; its stream ends with finish_reason "abort". False when
        the request is unknown or already finished."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return False
        self._aborts.add(request_id)
        if self._wake is not None:
            self._wake.set()
        return True

    async def _prepare_images(self, multi_modal_data: dict):
        """`engine.images.prepare` on the image thread: one request's images at a time (each request's
        images in parallel over the worker processes), each within the preprocessing timeout."""
        if self._image_executor is None:
            self._image_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-images")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._image_executor, self.engine.images.prepare, multi_modal_data)

    # ------------------------------------------------------------------ the step loop
    def _ensure_loop(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._drive(), name="deepinfer-engine-loop")

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_requests()
                if not self.engine.has_unfinished_requests():
                    if not self._admissions and not self._aborts:
                        self._wake.clear()
                        await self._wake.wait()
                    continue
                started = time.perf_counter()
                finished = await loop.run_in_executor(self._executor, self.engine.step)
                self._publish(finished)
                self._refresh_stats()
                if finished:
                    await self._await_replacements(len(finished), time.perf_counter() - started)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - every waiting request learns why, then the loop ends
            self._die(EngineDeadError(f"the engine's step loop stopped: {type(e).__name__}: {e}"))

    async def _await_replacements(self, num_finished: int, step_s: float) -> None:
        """Give the clients of requests that just finished a moment to send their next ones, so that
        those join the step scheduled next rather than the one after.

        In the asynchronous loop the model already runs the following step when `step()` returns, and
        the next `step()` schedules the one after it at once, before a client that got its final output
        can have sent its next request: without this wait that request would join a step later, its
        slot left empty meanwhile. The wait ends as soon as as many requests were added as finished, an
        abort is asked for, or REFILL_WAIT_FRACTION of the last step's time has passed (the step in
        flight then still leaves the host time to schedule and queue the next one). No wait without a
        step in flight (the synchronous loop, a speculative step, a parallel front, an idle engine):
        nothing would hide it, and a request added would be delayed by it."""
        step_in_flight = getattr(self.engine, "step_in_flight", None)
        if step_in_flight is None or not step_in_flight():
            return
        deadline = time.perf_counter() + REFILL_WAIT_FRACTION * step_s
        target = len(self._admissions) + num_finished
        while len(self._admissions) < target and not self._aborts:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    def _apply_requests(self) -> None:
        """Admit and abort between steps (on the event loop's thread, no step running)."""
        admissions, self._admissions = self._admissions, []
        for a in admissions:
            if a.admitted.done():  # its caller was cancelled while it was queued
                self._aborts.discard(a.request_id)
                continue
            try:
                self.engine.add_request(
                    a.request_id,
                    a.prompt,
                    a.params,
                    prompt_token_ids=a.prompt_token_ids,
                    arrival_time=a.arrival_time,
                    # (only with images: an engine without an image path, a launched rank, takes none)
                    **({} if a.multi_modal_data is None else {"multi_modal_data": a.multi_modal_data}),
                )
            except ValueError as e:
                self._forget(a.request_id)
                a.admitted.set_exception(e)
                continue
            a.admitted.set_result(None)
        aborts, self._aborts = self._aborts, set()
        for request_id in aborts:
            self.engine.abort_request(request_id)

    def _publish(self, finished: list[RequestOutput]) -> None:
        now = time.perf_counter()
        done = {out.request_id: out for out in finished}
        live = getattr(self.engine, "requests", {})
        # a data-parallel or disaggregated front holds no request states, but the latest outputs its
        # ranks (its decode engine) reported
        partial = getattr(self.engine, "partial_outputs", {})
        for request_id, stream in list(self._streams.items()):
            out = done.get(request_id)
            if out is None:
                state = live.get(request_id)
                if state is not None:
                    if sum(s.num_generated for s in state.seqs) == stream.tokens_seen:
                        continue
                    out = snapshot(state)
                else:
                    out = partial.get(request_id)
                    if out is None or num_tokens(out) == stream.tokens_seen:
                        continue
            new = num_tokens(out) - stream.tokens_seen
            gap = None if stream.last_delivery is None else now - stream.last_delivery
            if new > 0:
                stream.tokens_seen, stream.last_delivery = stream.tokens_seen + new, now
                self._waiting.discard(request_id)
            if new > 0 or out.finished:
                for listener in self.listeners:
                    listener(out, new, gap, now)
            stream.put(out)
            if out.finished:
                self._forget(request_id)

    def _refresh_stats(self) -> None:
        """What the engine counts, read between steps (its scheduler is not safe to read during one):
        "scheduler" (`scheduler_stats()`), "generated_tokens", "prompt_tokens", and with speculative
        decoding "draft_tokens" / "accepted_draft_tokens"."""
        engine = self.engine
        stats = {
            "scheduler": engine.scheduler_stats(),
            "generated_tokens": engine.stats.generated_tokens,
            "prompt_tokens": engine.stats.prompt_tokens,
        }
        spec = engine.spec_stats() if hasattr(engine, "spec_stats") else None
        if spec is not None:
            stats["draft_tokens"], stats["accepted_draft_tokens"] = spec["verified"], spec["accepted"]
        self.engine_stats = stats

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._waiting.discard(request_id)

    def _die(self, error: EngineDeadError) -> None:
        self._dead = error
        for a in self._admissions:
            if not a.admitted.done():
                a.admitted.set_exception(error)
        self._admissions = []
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        self._waiting.clear()

    def _check_running(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine is closed")
        if self._dead is not None:
            raise self._dead

    # ------------------------------------------------------------------ shutdown
    async def close(self) -> None:
        """Stop the loop, abort what is left (their streams end with an error) and close the engine."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        loop = asyncio.get_running_loop()
        # the executor's single thread runs this after any step still in flight
        await loop.run_in_executor(self._executor, self.engine.abort_all)
        self._die(EngineDeadError("the engine was closed"))
        # (closing the engine also ends a preparation still waiting on the image thread)
        await loop.run_in_executor(self._executor, self.engine.close)
        self._executor.shutdown(wait=True)
        if self._image_executor is not None:
            self._image_executor.shutdown(wait=True, cancel_futures=True)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _params(p: SamplingParams | dict | None) -> SamplingParams:
    if p is None:
        return SamplingParams()
    if isinstance(p, dict):
        return SamplingParams(**p)
    if isinstance(p, SamplingParams):
        return p.clone()
    raise ValueError(f"sampling params must be a SamplingParams or a dict, got {type(p).__name__}")
