"""Prefill / decode disaggregation: a front over one PROMPT and one COMPLETION engine process.

    LLM(model, disaggregation="shm").generate(prompts, params)      # or "tcp"; CLI: --disaggregation

`DisaggregatedEngine` offers the engine surface `LLM` and `AsyncLLM` drive (add_request, step,
has_unfinished_requests, abort_request, abort_all, close). Each request goes to the PROMPT engine, which
prefills it and sends its hand-off record (`handoff.py`) back over a link (`handoff_transport.py`: shared
memory on one host, or TCP); the front forwards the record to the COMPLETION engine, which imports the
blocks and decodes; its outputs are the request's outputs, equal to a NORMAL engine's (seeds are drawn
here from the engine seed's stream in arrival order, as one engine draws them).

Streaming: with `stream_outputs` on (an `AsyncLLM` turns it on, as over a data-parallel front), the
decode engine sends each request's output so far after every step that gave it tokens, and the latest one
of each unfinished request is in `partial_outputs` until its finished output replaces it.

Back-pressure: the COMPLETION engine reports the blocks and sequences its requests do not reserve
(`pd_roles.CompletionRole.capacity`); the front holds records that do not fit and sends them when they
do (a record the engine still finds too large comes back "full" and is held again). The PROMPT engine
gets a new request only while fewer than `disaggregation_max_held` requests are being prefilled, held, or
on their way to the decode engine.

Faults: an engine process that exits, reports an error, or sends nothing for `distributed_timeout`
seconds while it has work fails the requests it holds (each output's `error` names the engine and why),
and is started again; the front stays usable. If it cannot be started again, the front fails every
request and refuses new ones.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import connection
from pathlib import Path

import torch.multiprocessing as mp

from ..default_model import resolve_model
from ..engine_args import EngineArgs
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams, validate_vocab_fields
from ..tokenizer import load_tokenizer, load_tokenizer_config
from .disagg_process import engine_main
from .handoff import HandoffRecord
from .handoff_transport import ShmLink, TcpListener
from .images import ImagePreparer
from .pd_roles import refuse_for_split_engines
from .prompts import PromptChecks, front_seeds
from .stats import EngineStats

logger = logging.getLogger("deepinfer")

POLL_S = 0.5  # the longest step() waits for an output
ROLES = ("prompt", "completion")
_STAGES = {"prompt": ("prefill",), "completion": ("sent", "decode")}  # requests each engine holds


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    ids: list[int]
    params: SamplingParams
    seeds: list[int] | None
    arrival_time: float
    images: tuple | None = None  # (PreparedImages, the prompt ids as given): the prefill engine expands them
    stage: str = "queued"  # queued -> prefill -> held -> sent -> decode
    resent: bool = False  # its hand-off was in transit to a decode engine that stopped, and held again


@dataclass
class _Proc:
    role: str
    process: object
    conn: object
    link: object
    pid: int = 0
    heard_at: float = field(default_factory=time.monotonic)
    exited: bool = False


class DisaggregatedEngine(PromptChecks):
    def __init__(self, args: EngineArgs) -> None:
        if args.disaggregation == "off":
            raise ValueError("DisaggregatedEngine needs disaggregation='shm' or 'tcp', got 'off'")
        self.args = args
        self.transport = args.disaggregation
        self.max_held = args.disaggregation_max_held
        self.timeout_s = float(args.distributed_timeout)
        self.startup_timeout_s = float(args.distributed_startup_timeout)
        self.model_path, self.is_default_model = resolve_model(args.model)
        tok_path = Path(args.tokenizer) if args.tokenizer else self.model_path
        self.tokenizer = load_tokenizer(tok_path)
        self.tokenizer_config = load_tokenizer_config(tok_path)
        # requests with images are read and preprocessed here, expanded and encoded by the prefill engine
        self.images = ImagePreparer.for_checkpoint(self.model_path)
        self.stats = EngineStats()
        self.num_speculative_tokens = 0
        self.use_async = False  # both engines run the synchronous loop (pd_roles.py)
        self._seed_rng = random.Random(args.seed)
        self._requests: dict[str, _Request] = {}
        self._queued: deque[str] = deque()
        self._held: deque[tuple[str, bytes]] = deque()
        self.held_peak = 0  # most hand-offs held at once (back-pressure at work)
        self.sent_back = 0  # hand-offs the decode engine found too large for now and sent back
        self._sent: dict[str, bytes] = {}  # sent to the decode engine, not yet admitted
        self._capacity: dict = {}
        self._progress: dict[str, int] = {}
        # With record_token_times: per request, (when the front heard, output tokens so far), n = 1
        self.record_token_times = False
        self.token_times: dict[str, list[tuple[float, int]]] = {}
        self._ready: deque[RequestOutput] = deque()
        self.stream_outputs = False
        self.partial_outputs: dict[str, RequestOutput] = {}
        self._partial_arrived = False
        self._failed: str | None = None
        self._procs: dict[str, _Proc] = {}
        self.restarts = {r: 0 for r in ROLES}
        cpus = os.cpu_count() or 1
        self._threads = args.num_threads or max(1, cpus // 2)
        base = dataclasses.replace(
            args, model=str(self.model_path), disaggregation="off", async_scheduling=False, num_threads=None
        )
        self._role_args = {
            "prompt": dataclasses.replace(base, engine_type="prompt"),
            "completion": dataclasses.replace(base, engine_type="completion", stop_preempted_request=True),
        }
        self._ctx = mp.get_context("spawn")
        self._finalizer = weakref.finalize(self, _stop_all, self._procs)
        try:
            info = {}
            for role in ROLES:
                info = self._start(role)
        except BaseException:
            self.close()
            raise
        self.vocab_size = info["vocab_size"]
        self.max_model_len = info["max_model_len"]
        self.bos_token_id = info["bos_token_id"]
        self.eos_token_id = info["eos_token_id"]

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        multi_modal_data: dict | None = None,
    ) -> None:
        """Queue one request for the next `step()`; raises ValueError for what one engine rejects at
        once (before its seeds are drawn); what an engine rejects later comes back as its `error`.
        `multi_modal_data`: images, read and preprocessed here, expanded and encoded by the prefill engine
        (the decode engine gets the image positions and digests with the hand-off)."""
        self._check_usable()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        refuse_for_split_engines(params, "disaggregated")
        validate_vocab_fields(params, self.vocab_size)
        # (a request with images: its expanded prompt is known once prefilled, `_on_frame`)
        prompt_token_ids, images = self.front_request(prompt, prompt_token_ids, params, multi_modal_data)
        seeds = front_seeds(self._seed_rng, params)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self._requests[request_id] = _Request(
            request_id, prompt, list(prompt_token_ids), params, seeds, arrival, images
        )
        self._queued.append(request_id)
        self.stats.prompt_tokens += len(prompt_token_ids) * params.n

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._ready)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        """Move requests along (to the prefill engine, hand-offs to the decode engine) and return the
        outputs that have arrived, waiting up to POLL_S seconds for one (with `stream_outputs`, for any
        news in `partial_outputs`)."""
        self._check_usable()
        deadline = time.monotonic() + POLL_S
        self._partial_arrived = False
        while True:
            self._dispatch()
            self._forward()
            if self._ready or self._partial_arrived or not self._requests or time.monotonic() > deadline:
                break
            self._receive(max(0.0, min(0.05, deadline - time.monotonic())))
            self._watch()
        self.stats.steps += 1
        done = list(self._ready)
        self._ready.clear()
        for out in done:
            self.stats.generated_tokens += sum(len(c.token_ids) for c in out.outputs)
        return done

    def abort_request(self, request_id: str) -> bool:
        """Stop one request: False if the front does not hold it. Its output (finish_reason "abort", the
        tokens it had are not collected) comes from `step()`; the engine holding it frees its blocks."""
        self._check_usable()
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.partial_outputs.pop(request_id, None)
        if req.stage == "queued":
            self._queued.remove(request_id)
        elif req.stage == "prefill":
            self._send("prompt", ("abort", [request_id]))
        elif req.stage == "held":
            self._held = deque(h for h in self._held if h[0] != request_id)
        else:
            self._sent.pop(request_id, None)
            self._send("completion", ("abort", [request_id]))
        self._ready.append(_aborted_output(req))
        return True

    def abort_all(self) -> list[RequestOutput]:
        for request_id in list(self._requests):
            self.abort_request(request_id)
        done = list(self._ready)
        self._ready.clear()
        return done

    def num_generated(self, request_id: str) -> int:
        """Output tokens the decode engine has reported for a request still running."""
        return self._progress.get(request_id, 0)

    def stage_of(self, request_id: str) -> str | None:
        """Where a request is: queued, prefill, held, sent (to the decode engine), decode; None if gone."""
        req = self._requests.get(request_id)
        return None if req is None else req.stage

    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self._procs.items()}

    def scheduler_stats(self) -> dict:
        return {"held_handoffs": len(self._held), "decode_capacity": dict(self._capacity)}

    def spec_stats(self) -> None:
        return None

    def close(self) -> None:
        self._finalizer()
        if getattr(self, "images", None) is not None:
            self.images.close()
        if self._failed is None:
            self._failed = "the disaggregated engine is closed"

    # ------------------------------------------------------------------ moving requests along
    def _in_flight(self) -> int:
        return sum(1 for r in self._requests.values() if r.stage in ("prefill", "held", "sent"))

    def _dispatch(self) -> None:
        batch = []
        while self._queued and self._in_flight() + len(batch) < self.max_held:
            req = self._requests[self._queued.popleft()]
            req.stage = "prefill"
            batch.append(
                (req.request_id, req.prompt, req.ids, req.params, req.seeds, req.arrival_time, req.images)
            )
        if batch:
            self._send("prompt", ("add", batch, self.stream_outputs))

    def _need(self, req: _Request) -> dict:
        longest = min(len(req.ids) + req.params.max_tokens, self.max_model_len)
        n = req.params.n
        return {"free_blocks": -(-longest // self.args.block_size) * n, "free_seqs": n}

    def _forward(self) -> None:
        """Send held hand-offs that fit the decode engine's last reported capacity (or any one when it
        holds nothing: it then refuses a request that can never fit, with the reason)."""
        while self._held:
            rid, data = self._held[0]
            req = self._requests[rid]
            need = self._need(req)
            idle = not self._holds("completion")
            if not idle and any(self._capacity.get(k, 0) < v for k, v in need.items()):
                return
            self._held.popleft()
            req.stage = "sent"
            self._sent[rid] = data
            for k, v in need.items():
                self._capacity[k] = self._capacity.get(k, 0) - v
            proc = self._procs["completion"]
            if idle:  # its silence starts now
                proc.heard_at = time.monotonic()
            try:
                proc.link.send(data)
            except OSError as e:
                self._on_exit(proc, f"its hand-off link failed ({e})")
                return

    # ------------------------------------------------------------------ messages
    def _receive(self, timeout_s: float) -> None:
        sources = {}
        for proc in self._procs.values():
            sources[proc.conn] = (proc, "conn")
        prompt = self._procs.get("prompt")
        if prompt is not None:
            sources[prompt.link.waitable] = (prompt, "link")
        for w in connection.wait(list(sources), timeout=timeout_s):
            proc, kind = sources[w]
            if proc.exited:
                continue
            try:
                if kind == "link":
                    self._on_frame(proc.link.recv())
                else:
                    self._on_message(proc, proc.conn.recv())
            except (EOFError, OSError):
                self._check_exit(proc, wait_s=2.0)
            else:
                proc.heard_at = time.monotonic()

    def _on_frame(self, data: bytes) -> None:
        head = HandoffRecord.peek(data)
        rid = head["request_id"]
        req = self._requests.get(rid)
        if req is None or req.stage != "prefill":  # aborted meanwhile
            return
        if req.images is not None:  # its expanded prompt: what the decode engine will hold (`_need`)
            req.ids = list(head["prompt_token_ids"])
        req.stage = "held"
        self._held.append((rid, data))
        self.held_peak = max(self.held_peak, len(self._held))

    def _on_message(self, proc: _Proc, msg) -> None:
        kind = msg[0]
        if kind == "beat":
            return
        if kind == "error":
            self._on_exit(proc, f"it failed:\n{msg[2]}")
            return
        report = msg[-1]
        if proc.role == "completion":
            now = time.perf_counter()
            for rid, count in report.get("progress", {}).items():
                if rid in self._requests and count != self._progress.get(rid, 0):
                    self._progress[rid] = count
                    if self.record_token_times:
                        self._note_tokens(rid, now, count)
        if kind == "outputs":
            for out in msg[1]:
                if proc.role == "completion" and self.record_token_times and out.outputs:
                    self._note_tokens(out.request_id, now, len(out.outputs[0].token_ids))
                self._finish(out)
            for out in msg[2]:
                if out.request_id in self._requests:
                    self.partial_outputs[out.request_id] = out
                    self._partial_arrived = True
        elif kind == "admitted":
            req = self._requests.get(msg[1])
            self._sent.pop(msg[1], None)
            if req is not None:
                req.stage = "decode"
        elif kind == "full":
            data = self._sent.pop(msg[1], None)
            req = self._requests.get(msg[1])
            if req is not None and data is not None:
                self.sent_back += 1
                req.stage = "held"
                self._held.appendleft((msg[1], data))
        elif kind == "bad_frame":
            logger.warning("the completion engine could not read a hand-off: %s", msg[1])
        if proc.role == "completion" and "capacity" in report:
            self._set_capacity(report["capacity"])

    def _set_capacity(self, reported: dict) -> None:
        """The decode engine's free capacity as it reported it, less what the hand-offs on their way to it
        (sent, not yet admitted or sent back) will reserve: the report does not count them yet."""
        self._capacity = dict(reported)
        for rid in self._sent:
            for k, v in self._need(self._requests[rid]).items():
                self._capacity[k] = self._capacity.get(k, 0) - v

    def _note_tokens(self, rid: str, now: float, count: int) -> None:
        times = self.token_times.setdefault(rid, [])
        if not times or times[-1][1] != count:
            times.append((now, count))

    def _finish(self, out: RequestOutput) -> None:
        if self._requests.pop(out.request_id, None) is None:
            return  # aborted here already
        self._sent.pop(out.request_id, None)
        self._progress.pop(out.request_id, None)
        self.partial_outputs.pop(out.request_id, None)
        self._ready.append(out)

    # ------------------------------------------------------------------ processes
    def _start(self, role: str) -> dict:
        if self.transport == "shm":  # the prompt engine writes hand-offs, the completion engine reads them
            reader, writer = self._ctx.Pipe(duplex=False)
            link, spec = (
                (ShmLink(reader), ("shm", writer)) if role == "prompt" else (ShmLink(writer), ("shm", reader))
            )
        else:
            listener = TcpListener()
            spec = ("tcp", listener.host, listener.port)
        conn, child_conn = self._ctx.Pipe()
        p = self._ctx.Process(
            target=engine_main,
            args=(role, self._role_args[role], child_conn, spec, self._threads),
            name=f"deepinfer-{role}",
            daemon=True,
        )
        p.start()
        child_conn.close()
        if self.transport == "shm":
            spec[1].close()
        else:
            try:
                link = listener.accept(self.startup_timeout_s)
            except BaseException:
                p.kill()
                raise
        proc = _Proc(role, p, conn, link)
        self._procs[role] = proc
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"the {role} engine did not start within {self.startup_timeout_s:.0f} s "
                    "(distributed_startup_timeout)"
                )
            if conn.poll(min(left, 1.0)):
                try:
                    msg = conn.recv()
                except EOFError:
                    msg = ("error", 0, f"exited with code {p.exitcode}")
                if msg[0] == "error":
                    raise RuntimeError(f"the {role} engine failed to start:\n{msg[2]}")
                if msg[0] == "ready":
                    proc.pid = msg[1]["pid"]
                    if role == "completion":
                        self._set_capacity(msg[2]["capacity"])
                    return msg[1]
            elif p.exitcode is not None:
                raise RuntimeError(f"the {role} engine exited with code {p.exitcode} while starting")

    def _send(self, role: str, msg) -> None:
        proc = self._procs[role]
        if not self._holds(role):
            proc.heard_at = time.monotonic()  # it was idle: its silence starts now
        try:
            proc.conn.send(msg)
        except OSError as e:
            self._on_exit(proc, f"it is unreachable ({e})")

    def _watch(self) -> None:
        """Exited processes, and silent ones holding work, are handled as failed."""
        for proc in list(self._procs.values()):
            self._check_exit(proc)
        now = time.monotonic()
        for proc in list(self._procs.values()):
            if self._holds(proc.role) and now - proc.heard_at > self.timeout_s:
                self._on_exit(
                    proc,
                    f"it sent nothing for {now - proc.heard_at:.0f} s (distributed_timeout={self.timeout_s:.0f} s)",
                )

    def _holds(self, role: str) -> bool:
        stages = _STAGES[role]
        return any(r.stage in stages for r in self._requests.values())

    def _check_exit(self, proc: _Proc, wait_s: float = 0.0) -> None:
        proc.process.join(timeout=wait_s)
        if proc.process.exitcode is not None and not proc.exited:
            self._on_exit(proc, f"it exited with code {proc.process.exitcode}")

    def _on_exit(self, proc: _Proc, why: str) -> None:
        """Fail the requests `proc` held, then start its role again (or fail the whole front)."""
        if proc.exited:
            return
        proc.exited = True
        _kill([proc])
        self._drain(proc)
        _close([proc])
        role = proc.role
        stages = _STAGES[role]
        message = f"the {role} engine (pid {proc.pid}) stopped while holding this request: {why}"
        logger.warning("%s", message)
        if role == "completion":
            self._hold_again_in_transit()
        for req in list(self._requests.values()):
            if req.stage in stages:
                self._finish(_failed_output(req, message))
        try:
            self._start(role)
        except BaseException as e:  # noqa: BLE001 - the front cannot go on without the role
            self._failed = f"the {role} engine could not be started again: {type(e).__name__}: {e}"
            for req in list(self._requests.values()):
                self._finish(_failed_output(req, self._failed))
            self._queued.clear()
            self._held.clear()
            return
        self.restarts[role] += 1

    def _hold_again_in_transit(self) -> None:
        """Hand-offs sent to a decode engine that stopped before it admitted them (or sent them back) are
        held again for its successor: it produced nothing for them, so nothing is lost or repeated. Once
        only: a hand-off in transit to two engines that stopped fails (it may be what stops them)."""
        again = []
        for rid, data in list(self._sent.items()):
            req = self._requests[rid]
            if not req.resent:
                req.resent, req.stage = True, "held"
                again.append((rid, data))
                del self._sent[rid]
        self._held.extendleft(reversed(again))

    def _drain(self, proc: _Proc) -> None:
        """Take what a stopped engine sent before it stopped, so that a request it finished keeps its
        output and a hand-off it sent back as full is held again, instead of failing with it (the loop
        reads one message per wait, and may see the exit first)."""
        while True:
            try:
                if not proc.conn.poll():
                    return
                msg = proc.conn.recv()
            except (EOFError, OSError):  # all read, or a message cut short by the exit
                return
            self._on_message(proc, msg)

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"the disaggregated engine cannot be used: {self._failed}")


def _aborted_output(req: _Request) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=req.arrival_time, num_prompt_tokens=len(req.ids))
    metrics.finish_time = time.perf_counter()
    outputs = [CompletionOutput(index=i, finish_reason="abort") for i in range(req.params.n)]
    return RequestOutput(req.request_id, req.prompt, list(req.ids), outputs, metrics)


def _failed_output(req: _Request, message: str) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=req.arrival_time, num_prompt_tokens=len(req.ids))
    metrics.finish_time = time.perf_counter()
    return RequestOutput(req.request_id, req.prompt, list(req.ids), [], metrics, error=message)


def _stop(procs: list[_Proc]) -> None:
    _kill(procs)
    _close(procs)


def _kill(procs: list[_Proc]) -> None:
    for proc in procs:
        if proc.process.is_alive():
            proc.process.kill()
    for proc in procs:
        proc.process.join(timeout=5.0)


def _close(procs: list[_Proc]) -> None:
    for proc in procs:
        for end in (proc.conn, proc.link):
            try:
                end.close()
            except OSError:
                pass


def _stop_all(procs: dict) -> None:
    """Ask the engines to close, give them 10 s, then kill the rest (the dict is the front's own,
    emptied here, so a second call does nothing)."""
    for proc in procs.values():
        if proc.process.is_alive():
            try:
                proc.conn.send(("close",))
            except OSError:
                pass
    deadline = time.monotonic() + 10.0
    for proc in procs.values():
        proc.process.join(timeout=max(0.0, deadline - time.monotonic()))
    _stop(list(procs.values()))
    procs.clear()


__all__ = ["DisaggregatedEngine"]
