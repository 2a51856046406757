"""One data-parallel rank's process: build its `LLMEngine` (with a `DataParallelRank`), then serve the
front's messages (`data_parallel.py`), sending outputs and statistics back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import signal
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ..engine_args import EngineArgs
from ..outputs import RequestMetrics, RequestOutput
from .dp_rank import DataParallelRank
from .llm_engine import LLMEngine

HEARTBEAT_S = 5.0  # a running rank reports its stats at least this often
BEAT_S = 1.0  # a running rank's sign of life (from a thread of its own) at least this often


class _Outbox:
    """Messages to the front, sent by a thread: the rank never blocks on a full pipe and keeps reading
    the front's messages (a front sending a large batch while this rank's unread outputs fill the
    other direction would otherwise deadlock)."""

    def __init__(self, conn):
        self._conn, self._queue = conn, queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="deepinfer-dp-outbox", daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        self._queue.put(msg)

    def _run(self) -> None:
        while (msg := self._queue.get()) is not None:
            self._conn.send(msg)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)


class _Heartbeat:
    """While the rank runs (between a front message and its "idle" report), a thread sends
    ("beat", rank, progress) every `period_s`: the front tells a rank that is frozen or dead (no beat)
    from one that is alive but waiting, e.g. in a collective for a frozen peer (beats, but `progress`,
    the steps and messages the main thread got through, stands still)."""

    def __init__(self, outbox: _Outbox, rank: int, period_s: float):
        self.outbox, self.rank, self.period_s = outbox, rank, period_s
        self.progress = 0  # bumped by the main thread only
        self.running = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepinfer-dp-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.running:
                self.outbox.send(("beat", self.rank, self.progress))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period_s + 1.0)


def _rank_main(
    rank: int, world: int, init_file: str, args: EngineArgs, conn, startup_timeout_s: float, timeout_s: float
) -> None:
    """Entry point of one DP rank's process: build the engine, then serve the front's messages.
    `startup_timeout_s` bounds the rendezvous, `timeout_s` a silent rank once running; the process
    groups' collectives wait up to the larger (the front, which watches every rank, fails first)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front, which aborts by message
    engine = dp = None
    outbox = _Outbox(conn)
    beat = _Heartbeat(outbox, rank, min(BEAT_S, timeout_s / 4))
    try:
        from deepinfer_parallel import init_parallel

        if args.num_threads is None:  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        ep, device = args.expert_parallel_size, args.torch_device
        cuda = device.type == "cuda"
        if cuda:  # one GPU per rank
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        # The rank's engine is one process on one device; the world's sizes live in DataParallelRank
        # (EngineArgs refuses `cuda:N` with data_parallel_size > 1: that check is for the user's choice).
        args = dataclasses.replace(args, device=str(device), data_parallel_size=1, expert_parallel_size=1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
            timeout=timedelta(seconds=max(startup_timeout_s, timeout_s)),
        )  # fmt: skip
        state = init_parallel(dp=world, cp=1, ep=ep, backend="nccl" if cuda else "gloo")
        dp = DataParallelRank(state, device)
        engine = LLMEngine(args, dp=dp)
        outbox.send(
            (
                "ready",
                rank,
                {
                    "vocab_size": engine.vocab_size,
                    "max_model_len": engine.max_model_len,
                    "bos_token_id": engine.bos_token_id,
                    "eos_token_id": engine.eos_token_id,
                    "stats": _stats(engine),  # the front's statistics have their shape from the start
                },
            )
        )
        _serve(engine, dp, conn, outbox, beat)
    except BaseException:  # noqa: BLE001 - every failure goes to the front as text, then the rank exits
        outbox.send(("error", rank, traceback.format_exc()))
        outbox.close()
        raise SystemExit(1) from None
    finally:
        beat.close()
        outbox.close()
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.close()
        if dp is not None:
            with contextlib.suppress(Exception):
                dp.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _serve(engine, dp: DataParallelRank, conn, outbox: _Outbox, beat: _Heartbeat) -> None:
    """Wait for a message; run engine steps until no rank of the EP group has work; repeat.

    The front sends every batch to every rank (possibly empty), so all ranks of a group start a run
    together; messages arriving during a run are handled between steps (the vote sees the new work,
    and the count of messages taken in, so that no rank leaves the run with a message unread that
    another rank already acted on).
    """
    while True:
        msg = conn.recv()
        beat.running = True
        if not _handle(engine, dp.rank, msg, outbox):
            return
        dp.messages += 1
        beat.progress += 1
        last_sent = time.monotonic()
        while True:
            while conn.poll():
                if not _handle(engine, dp.rank, conn.recv(), outbox):
                    return
                dp.messages += 1
                beat.progress += 1
            done = engine.step()
            beat.progress += 1
            if done or time.monotonic() - last_sent > HEARTBEAT_S:
                outbox.send(("outputs", dp.rank, done, _stats(engine)))
                last_sent = time.monotonic()
            if not dp.any_busy:
                break
        dp.wait_idle_forwards()  # so the counters sent below cover every forward of the run
        beat.running = False
        outbox.send(("idle", dp.rank, [], _stats(engine), dp.messages))


def _handle(engine, rank: int, msg, outbox: _Outbox) -> bool:
    """Apply one front message; False on close."""
    kind = msg[0]
    if kind == "close":
        return False
    if kind == "add":
        failed = []
        for rid, prompt, ids, params, seeds in msg[1]:
            try:
                engine.add_request(rid, prompt, params, prompt_token_ids=ids, seeds=seeds)
            except ValueError as e:  # this request alone fails; the others and the world go on
                failed.append(RequestOutput(rid, prompt, ids or [], [], RequestMetrics(0.0), error=str(e)))
        if failed:
            outbox.send(("outputs", rank, failed, _stats(engine)))
    elif kind == "abort":
        # Not abort_all: it waits for the forwards in flight, which the other ranks join only at
        # the next vote. The step loop settles them instead. msg[1]: the request ids (every rank
        # gets every abort, so the ranks' message counts stay equal; ids it does not hold are
        # skipped), None for all.
        for rid in list(engine.requests) if msg[1] is None else msg[1]:
            engine.abort_request(rid)
    else:
        raise ValueError(f"unknown message {kind!r} from the front process")
    return True


def _stats(engine) -> dict:
    out = {
        f.name: getattr(engine.stats, f.name)
        for f in dataclasses.fields(engine.stats)
        if isinstance(getattr(engine.stats, f.name), int | float)
    }
    if engine.dp is not None:
        out.update(engine.dp.eplb_stats())
    out["scheduler"] = engine.scheduler_stats()
    return out
