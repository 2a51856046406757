"""One engine process of a disaggregated front (`disaggregated.py`): a PROMPT engine that prefills the
requests the front sends and ships their hand-offs back over its link, or a COMPLETION engine that takes
hand-offs from its link and decodes them.

Control messages travel on a pipe, hand-off frames on the link (`handoff_transport.py`). Front to engine:
("add", [(request_id, prompt, ids, params, seeds, arrival_time)], stream) (PROMPT), ("abort", [ids]),
("close",). Engine to front: ("ready", info), ("outputs", [RequestOutput], [partial RequestOutput], report),
("admitted", request_id, report), ("full", request_id, report) (a hand-off that did not fit: the front holds
it and sends it again), ("beat", role, progress), ("error", role, traceback). `report`: the COMPLETION
engine's free capacity and, per request it holds, the output tokens so far.

Streaming (an `AsyncLLM` over the front): the "add" message says whether the front streams its requests;
the PROMPT engine marks their records (`meta["stream"]`), and the COMPLETION engine sends a snapshot of
each marked request after every step that gave it tokens (`rank_streaming.py`, as a data-parallel rank).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
import traceback
from multiprocessing import connection

import torch

from ..engine_args import EngineArgs
from ..outputs import RequestMetrics, RequestOutput
from .handoff import HandoffRecord
from .llm_engine import LLMEngine
from .pd_roles import DecodeFull
from .prompts import engine_prompt
from .rank_process import _Heartbeat
from .rank_streaming import StreamedRequests

REPORT_S = 1.0  # a busy engine reports at least this often


class _Sender:
    """Control messages and hand-off frames, sent by a thread: the engine never blocks on a full pipe
    or socket while the front is busy sending to it."""

    def __init__(self, conn, link) -> None:
        self.conn, self.link = conn, link
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="deepinfer-pd-sender", daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        self._queue.put(("conn", msg))

    def send_frame(self, data: bytes) -> None:
        self._queue.put(("link", data))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, what = item
            if kind == "conn":
                self.conn.send(what)
            else:
                self.link.send(what)

    def close(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)


def engine_main(role: str, args: EngineArgs, conn, link_spec, num_threads: int | None) -> None:
    """Entry point of the `role` ("prompt" / "completion") engine's process."""
    from .handoff_transport import open_child_link

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front, which aborts by message
    if num_threads:
        torch.set_num_threads(num_threads)
    engine = link = sender = beat = None
    index = 0 if role == "prompt" else 1
    try:
        link = open_child_link(link_spec)
        sender = _Sender(conn, link)
        beat = _Heartbeat(sender, index, 1.0)
        engine = LLMEngine(args)
        info = {
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "bos_token_id": engine.bos_token_id,
            "eos_token_id": engine.eos_token_id,
            "pid": os.getpid(),
        }
        sender.send(("ready", info, _report(engine)))
        _serve(engine, role, conn, link, sender, beat)
    except BaseException:  # noqa: BLE001 - every failure goes to the front as text, then the process exits
        if sender is not None:
            sender.send(("error", index, traceback.format_exc()))
            sender.close()
        raise SystemExit(1) from None
    finally:
        if beat is not None:
            beat.close()
        if sender is not None:
            sender.close()
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.close()
        if link is not None:
            with contextlib.suppress(Exception):
                link.close()


def _serve(engine: LLMEngine, role: str, conn, link, sender: _Sender, beat) -> None:
    waitables = [conn, link.waitable] if role == "completion" else [conn]
    # PROMPT: the requests whose records go out marked for streaming; COMPLETION: the marked ones admitted
    to_mark: set[str] = set()
    streamed = StreamedRequests()
    last_report = 0.0
    while True:
        busy = engine.has_unfinished_requests()
        beat.running = busy
        ready = connection.wait(waitables, timeout=0 if busy else None)
        for w in ready:
            if w is conn:
                if not _handle(engine, conn.recv(), sender, to_mark):
                    return
            else:
                _take_handoff(engine, link.recv(), sender, streamed)
            beat.progress += 1
        if not engine.has_unfinished_requests():
            continue
        done = engine.step()
        beat.progress += 1
        partial = []
        if role == "prompt":
            for record in engine.take_handoffs():
                if record.request_id in to_mark:
                    record.meta["stream"] = True
                sender.send_frame(record.to_bytes())
            to_mark.intersection_update(engine.requests)  # the others are sent, failed or aborted
            done = [o for o in done if o.error is not None or _reason(o) != "prefilled"]
        else:
            partial = streamed.take(engine, done)
        now = time.monotonic()
        if done or role == "completion" or now - last_report > REPORT_S:
            sender.send(("outputs", done, partial, _report(engine)))
            last_report = now


def _reason(out: RequestOutput) -> str | None:
    return out.outputs[0].finish_reason if out.outputs else None


def _handle(engine: LLMEngine, msg, sender: _Sender, to_mark: set[str]) -> bool:
    kind = msg[0]
    if kind == "close":
        return False
    if kind == "add":  # msg[2]: the front streams these requests' outputs as they grow
        failed = []
        for rid, prompt, ids, params, seeds, arrival, images in msg[1]:
            try:
                given, mm = engine_prompt(ids, images)
                engine.add_request(
                    rid, prompt, params, prompt_token_ids=given, arrival_time=arrival, seeds=seeds,
                    multi_modal_data=mm,
                )  # fmt: skip
            except ValueError as e:
                failed.append(RequestOutput(rid, prompt, ids or [], [], RequestMetrics(0.0), error=str(e)))
                continue
            if msg[2]:
                to_mark.add(rid)
        if failed:
            sender.send(("outputs", failed, [], _report(engine)))
    elif kind == "abort":
        for rid in msg[1]:  # the outputs come from the next step()
            engine.abort_request(rid)
    else:
        raise ValueError(f"unknown message {kind!r} from the disaggregated front")
    return True


def _take_handoff(engine: LLMEngine, data: bytes, sender: _Sender, streamed: StreamedRequests) -> None:
    try:
        record = HandoffRecord.from_bytes(data)
    except ValueError as e:  # a malformed frame: nothing names its request reliably
        sender.send(("bad_frame", str(e), _report(engine)))
        return
    try:
        engine.add_handoff(record)
    except DecodeFull:
        sender.send(("full", record.request_id, _report(engine)))
        return
    except ValueError as e:  # HandoffError, or the request itself: it fails alone
        out = RequestOutput(
            record.request_id,
            record.prompt,
            list(record.prompt_token_ids),
            [],
            RequestMetrics(0.0),
            error=str(e),
        )
        sender.send(("outputs", [out], [], _report(engine)))
        return
    if record.meta.get("stream"):
        streamed.add(record.request_id)
    sender.send(("admitted", record.request_id, _report(engine)))


def _report(engine: LLMEngine) -> dict:
    out = {"progress": {rid: sum(s.num_generated for s in st.seqs) for rid, st in engine.requests.items()}}
    if engine.engine_type == "completion":
        out["capacity"] = engine.handoff_capacity()
    return out
