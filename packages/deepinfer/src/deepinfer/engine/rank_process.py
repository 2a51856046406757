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

HEARTBEAT_S = 5.0  # a running rank reports (its stats) at least this often, so silence means trouble


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


def _rank_main(rank: int, world: int, init_file: str, args: EngineArgs, conn, timeout_s: float) -> None:
    """Entry point of one DP rank's process: build the engine, then serve the front's messages."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front, which aborts by message
    engine = dp = None
    outbox = _Outbox(conn)
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
            timeout=timedelta(seconds=timeout_s),
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
                },
            )
        )
        _serve(engine, dp, conn, outbox)
    except BaseException:  # noqa: BLE001 - every failure goes to the front as text, then the rank exits
        outbox.send(("error", rank, traceback.format_exc()))
        outbox.close()
        raise SystemExit(1) from None
    finally:
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


def _serve(engine, dp: DataParallelRank, conn, outbox: _Outbox) -> None:
    """Wait for a message; run engine steps until no rank of the EP group has work; repeat.

    The front sends every batch to every rank (possibly empty), so all ranks of a group start a run
    together; messages arriving during a run are handled between steps (the vote sees the new work,
    and the count of messages taken in, so that no rank leaves the run with a message unread that
    another rank already acted on).
    """
    while True:
        if not _handle(engine, dp.rank, conn.recv(), outbox):
            return
        dp.messages += 1
        last_sent = time.monotonic()
        while True:
            while conn.poll():
                if not _handle(engine, dp.rank, conn.recv(), outbox):
                    return
                dp.messages += 1
            done = engine.step()
            if done or time.monotonic() - last_sent > HEARTBEAT_S:
                outbox.send(("outputs", dp.rank, done, _stats(engine)))
                last_sent = time.monotonic()
            if not dp.any_busy:
                break
        dp.wait_idle_forwards()  # so the counters sent below cover every forward of the run
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
        # the next vote. The step loop settles them instead.
        for rid in list(engine.requests):
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
    return out
