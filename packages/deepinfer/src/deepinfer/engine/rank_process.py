"""One data-parallel rank's process: build its `LLMEngine` (with a `DataParallelRank`), then serve the
front's messages (`data_parallel.py`), sending outputs and statistics back, and under the balanced
routing policy its load after every step (`dp_balance.RankLoad`) and the waiting requests a move asks
for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from ..engine_args import EngineArgs
from ..outputs import RequestMetrics, RequestOutput
from .dp_balance import RankLoad, request_cost
from .dp_rank import DataParallelRank
from .llm_engine import LLMEngine
from .prompts import engine_prompt
from .rank_streaming import StreamedRequests
from .step_trace import StepTrace

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


def open_rank(
    rank: int, local_rank: int, args: EngineArgs, init_method: str, timeout_s: float, local_world: int
) -> tuple[LLMEngine, DataParallelRank]:
    """Join the world of `args.layout` as `rank` (gloo default group through `init_method`: a file on
    one host, `env://` for a launched world) and build this rank's engine: its model holds the routed
    experts of its EP slots, its steps vote with the EP group. `local_rank` picks the GPU (`cuda:N`);
    `local_world` ranks share this host's cores. Collectives wait up to `timeout_s`."""
    layout = args.layout
    if args.num_threads is None:  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    device = args.torch_device
    if device.type == "cuda":  # one GPU per rank
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=layout.world_size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    return rank_engine(args, device)


def rank_engine(args: EngineArgs, device: torch.device) -> tuple[LLMEngine, DataParallelRank]:
    """This rank's engine and its `DataParallelRank` in a world already joined (the default process
    group up): the process groups of `args.layout`, then the engine on `device`."""
    from deepinfer_parallel import init_parallel

    layout = args.layout
    # The rank's engine is one process on one device; the world's sizes live in DataParallelRank
    # (EngineArgs refuses `cuda:N` with several ranks: that check is for the user's choice).
    rank_args = dataclasses.replace(
        args, device=str(device), data_parallel_size=1, context_parallel_size=1, expert_parallel_size=1,
        launcher="spawn",
    )  # fmt: skip
    backend = "nccl" if device.type == "cuda" else "gloo"
    state = init_parallel(dp=layout.dp, cp=layout.cp, ep=layout.ep, backend=backend)
    dp = DataParallelRank(state, device)
    return LLMEngine(rank_args, dp=dp), dp


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
        engine, dp = open_rank(
            rank, rank, args, f"file://{init_file}", max(startup_timeout_s, timeout_s), world
        )
        outbox.send(
            (
                "ready",
                rank,
                {
                    "vocab_size": engine.vocab_size,
                    "max_model_len": engine.max_model_len,
                    "bos_token_id": engine.bos_token_id,
                    "eos_token_id": engine.eos_token_id,
                    "stats": _stats(engine, dp),  # the front's statistics have their shape from the start
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
    another rank already acted on; the ranks of a context-parallel group also apply each message
    between the same two steps, `Inbox`). While the front has step tracing on, every step is timed
    here (`step_trace.py`) and the records travel with the statistics. Requests the front streams get
    a snapshot after each step that gave them tokens (`rank_streaming.py`), sent with the finished
    ones. Of a context-parallel group only the first rank sends outputs, load reports and released
    requests (the others computed the same).
    """
    trace = dp.step_trace = StepTrace(async_loop=engine.pipeline is not None)
    eplb = dp.collectives.eplb if dp.collectives is not None else None
    if eplb is not None:
        eplb.add_listener(trace.on_event)
    streamed = StreamedRequests()
    reports = dp.state.cp.rank_in_group == 0
    # the group's load, from its first rank (its context-parallel ranks hold the same requests)
    reports_load = reports and engine.args.dp_routing == "balanced"
    load = None
    inbox = Inbox(conn, dp.state.cpu_cp.group if dp.state.cp.size > 1 else None)
    while True:
        inbox.wait()
        beat.running = True
        last_sent = time.monotonic()
        while True:
            for msg in inbox.take():
                if not _handle(engine, dp, msg, outbox, streamed, reports):
                    return
                dp.messages += 1
                beat.progress += 1
            dp.held_messages = inbox.held
            done = _traced_step(engine, dp, trace) if trace.enabled else engine.step()
            beat.progress += 1
            if reports_load and (now := _load(engine, dp)) != load:
                load = now
                outbox.send(("load", dp.rank, load))
            partial = streamed.take(engine, done)
            if not reports:
                done, partial = [], []
            if done or partial or time.monotonic() - last_sent > HEARTBEAT_S:
                outbox.send(("outputs", dp.rank, done, _stats(engine, dp), partial))
                last_sent = time.monotonic()
            if not dp.any_busy:
                break
        dp.wait_idle_forwards()  # so the counters sent below cover every forward of the run
        beat.running = False
        outbox.send(("idle", dp.rank, [], _stats(engine, dp), dp.messages))


class Inbox:
    """The front's messages this rank has read and not yet applied.

    The ranks of one context-parallel group run the same steps (each step's rows are split among them,
    a collective per layer), so each message (requests added, an abort) must reach their schedulers
    between the same two steps. The front sends each of them the same messages in the same order; before
    every step the group agrees (an all-reduce on the gloo `cpu_cp` group) on how many every one of them
    has read, and each applies that many. `held`: some rank of the group has read more than that, so
    the group stays in its run loop (the vote counts it as work) until the others have read them too.
    Without a group (no context parallelism) a rank applies what it has read."""

    def __init__(self, conn, group) -> None:
        self.conn, self.group = conn, group
        self.queue: deque = deque()
        self.held = False

    def wait(self) -> None:
        """Between runs: block until a message is there."""
        if not self.queue:
            self.queue.append(self.conn.recv())

    def take(self) -> list:
        """The messages to apply before this step (collective over the group, when there is one)."""
        while self.conn.poll():
            self.queue.append(self.conn.recv())
        count = len(self.queue)
        if self.group is not None:
            counts = torch.tensor([-count, count], dtype=torch.int64)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.group)
            count, most = -int(counts[0]), int(counts[1])
            self.held = most > count
        return [self.queue.popleft() for _ in range(count)]


def _traced_step(engine, dp: DataParallelRank, trace: StepTrace) -> list[RequestOutput]:
    """`engine.step()`, timed and recorded in `trace`."""
    decoding = all(seq.num_generated > 0 for state in engine.requests.values() for seq in state.seqs)
    generated = engine.stats.generated_tokens
    start = time.perf_counter()
    done = engine.step()
    end = time.perf_counter()
    sched = engine.scheduler_stats()
    trace.record(
        start, end, emitted_tokens=engine.stats.generated_tokens - generated,
        running=int(sched["num_running"]), waiting=int(sched["num_waiting"]), decoding=decoding,
        finished=len(done), forwards=dp.launched,
    )  # fmt: skip
    return done


def _handle(
    engine, dp: DataParallelRank, msg, outbox: _Outbox, streamed: StreamedRequests, reports: bool = True
) -> bool:
    """Apply one front message; False on close. `reports`: this rank sends the outputs of requests that
    fail here and the requests a release withdrew (the first rank of a context-parallel group; the
    others fail and withdraw them alike)."""
    kind, rank = msg[0], dp.rank
    if kind == "close":
        return False
    if kind == "add":  # msg[2]: stream these requests' outputs as they grow
        failed = []
        for rid, prompt, ids, params, seeds, images in msg[1]:
            try:
                given, mm = engine_prompt(ids, images)
                engine.add_request(
                    rid, prompt, params, prompt_token_ids=given, seeds=seeds, multi_modal_data=mm
                )
            except ValueError as e:  # this request alone fails; the others and the world go on
                failed.append(RequestOutput(rid, prompt, ids or [], [], RequestMetrics(0.0), error=str(e)))
                continue
            if msg[2]:
                streamed.add(rid)
        if failed and reports:
            outbox.send(("outputs", rank, failed, _stats(engine, dp), []))
    elif kind == "abort":
        # Not abort_all: it waits for the forwards in flight, which the other ranks join only at
        # the next vote. The step loop settles them instead. msg[1]: the request ids (every rank
        # gets every abort, so the ranks' message counts stay equal; ids it does not hold are
        # skipped), None for all.
        for rid in list(engine.requests) if msg[1] is None else msg[1]:
            engine.abort_request(rid)
    elif kind == "release":  # msg[1]: the data-parallel group asked, msg[2]: at most this many tokens
        # Every rank of the group withdraws: its context-parallel ranks hold the same requests in the
        # same states (same messages between the same steps), so they withdraw the same ones.
        if msg[1] == rank // dp.state.cp.size:
            released = _release(engine, msg[2])
            if reports:
                outbox.send(("released", rank, released))
    elif kind == "trace":  # msg[1]: step tracing on (afresh) or off
        dp.step_trace.restart(bool(msg[1]))
    else:
        raise ValueError(f"unknown message {kind!r} from the front process")
    return True


def _load(engine, dp: DataParallelRank) -> RankLoad:
    """Tokens still to compute in this rank's requests (prompt and output budget of every unfinished
    sample, less what it has computed), of which in requests that could move, and KV usage."""
    queued, movable = engine.table.tokens_left()
    kv_usage = float(engine.scheduler_stats()["kv_usage"])
    return RankLoad(queued_tokens=queued, movable_tokens=movable, kv_usage=kv_usage, messages=dp.messages)


def _release(engine, budget_tokens: int) -> list[tuple]:
    """Withdraw waiting requests that have not started, newest first (they would run last here), of at
    most `budget_tokens` in all; returned as the front's add entries (seeds kept, so outputs do not change)."""
    out = []
    for rid, state in reversed(list(engine.requests.items())):
        cost = request_cost(
            len(state.prompt_token_ids), state.params.max_tokens, state.params.n, engine.max_model_len
        )
        if cost > budget_tokens or engine.withdraw_request(rid) is None:
            continue
        budget_tokens -= cost
        out.append(
            (rid, state.prompt, state.prompt_token_ids, state.params, [seq.seed for seq in state.seqs], None)
        )
    return out


def _stats(engine, dp: DataParallelRank) -> dict:
    out = {
        f.name: getattr(engine.stats, f.name)
        for f in dataclasses.fields(engine.stats)
        if isinstance(getattr(engine.stats, f.name), int | float)
    }
    out.update(dp.eplb_stats())
    out["scheduler"] = engine.scheduler_stats()
    out["spec_counts"] = engine.spec_counts()
    trace = dp.step_trace
    # who this rank is (a benchmark reports the processes that ran), and its step records so far
    out["identity"] = {
        "rank": dp.rank, "pid": os.getpid(), "host": socket.gethostname(), "ep_rank": dp.state.ep.rank_in_group,
        "ep_ranks": list(dp.state.ep.ranks), "cp_ranks": list(dp.state.cp.ranks),
        "draft_experts_sharded": dp.draft_collectives is not None, "eplb": dp.collectives is not None and dp.collectives.eplb is not None,
        "async_loop": engine.pipeline is not None,
    }  # fmt: skip
    if trace is not None and trace.enabled:
        out["step_trace"] = trace.take()
        out["step_trace_events"] = dict(trace.event_counts)
    return out
