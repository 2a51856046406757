"""Attention data parallel, context parallel and MoE expert parallel over N local processes (engine spec
§3.1, §7.1, §7.2, §7.3).

    LLM(model, data_parallel_size=2, expert_parallel_size=2).generate(prompts, params)
    LLM(model, context_parallel_size=2).generate(prompts, params)

The front process (`DataParallelEngine`, used by `LLM` when the layout has several ranks) spawns one
process per rank. Each rank builds its own `LLMEngine`: tokenizer, its own `deepinfer_sched`
scheduler, KV pools, and a model whose routed experts are sharded over the EP group (only the local
experts are loaded). The front routes requests to data-parallel groups (`dp_balance.py`: by default on
the groups' reported load and the prompts' cached prefixes, moving waiting requests that have not started
between groups when one is overloaded), sends them, and gathers the `RequestOutput`s back: the finished
ones, and for an `AsyncLLM` (which turns `stream_outputs` on) each request's output so far after every
step that gave it tokens. Without context parallelism a group is one rank.

Why ranks must agree every step: each MoE layer of a forward is an all-to-all over the EP group, so
every EP rank must run the same number of forwards. Each engine step, the ranks of an EP group take
one vote (`DataParallelRank.agree`, an all-reduce on the gloo `cpu_ep` group, so the async loop does
not wait for the device): how many forwards has each rank submitted so far, and does any rank still
have requests. A rank behind the maximum submits idle forwards (every MoE layer's all-to-all joined
with no tokens) to catch up; the loop ends when no rank of the group has work. The vote happens
before the engine waits for a forward, so no rank ever waits for a forward the others have not been
told to join.

Context parallel: a data-parallel group is `context_parallel_size` rank processes (contiguous ranks).
Each of them gets the group's share of the requests and runs the same steps, splitting every chunk's
rows with the mirror balance (runtime/cp_rows.py in deepinfer-model, the same engine as on launched
ranks); they apply the front's messages between the same two steps (`rank_process.Inbox`), and the
first of them reports the outputs and counters.

Layout: this file is the front; a rank's process is `rank_process.py`, what its engine holds to take
part in the vote `dp_rank.py`.

Process model: `spawn` (safe with CUDA), gloo default group through a file rendezvous, the device
group NCCL on CUDA (one GPU per rank, `cuda:rank`) and gloo on the CPU. Children ignore SIGINT (the
front aborts them through a message) and die with the front (daemon processes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import shutil
import tempfile
import time
import weakref
from collections import deque
from multiprocessing import connection
from pathlib import Path

import torch.multiprocessing as mp
from deepinfer_cluster import no_multicast_environment
from deepinfer_model import check_checkpoint_context_parallel, check_prompt_logprobs

from ..default_model import resolve_model
from ..engine_args import EngineArgs
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams, validate_vocab_fields
from ..tokenizer import load_tokenizer, load_tokenizer_config
from .dp_balance import BalanceConfig, Move, Router, assign_ranks, request_cost
from .dp_rank import DataParallelRank
from .images import ImagePreparer, image_tokens
from .prompts import PromptChecks, front_seeds
from .rank_process import _rank_main
from .stats import EngineStats
from .structured import StructuredOutputs
from .truncation import settings_from_env

logger = logging.getLogger("deepinfer")

POLL_S = 1.0  # how often the front checks that its ranks are alive while it waits


# ---------------------------------------------------------------------------- the front process
@dataclasses.dataclass
class DataParallelStats(EngineStats):
    """The front's `EngineStats` (the ranks' counters summed, `steps` the largest) plus what run-time
    EPLB did (`EplbRunStats` of each EP group, zero without it): rebalances, layers changed, bytes
    moved and seconds summed over the groups; step counts and the load ratios (peak / mean rank
    load, 1.0 = balanced) the largest over the groups."""

    eplb_steps: int = 0
    eplb_prompt_steps: int = 0
    eplb_rebalances: int = 0
    eplb_layers_changed: int = 0
    eplb_bytes_moved: int = 0
    eplb_seconds: float = 0.0
    eplb_imbalance_before: float = 0.0
    eplb_imbalance_after: float = 0.0
    eplb_moe_lb_initial: float = 0.0
    eplb_moe_lb: float = 0.0


_EPLB_SUMMED = ("eplb_rebalances", "eplb_layers_changed", "eplb_bytes_moved", "eplb_seconds")


class DataParallelEngine(PromptChecks):
    """The `LLMEngine` interface `LLM` uses, served by `data_parallel_size` rank processes.

    `add_request` queues; the next `step()` sends the queued requests to the ranks and returns the
    outputs that arrive; `abort_request` / `abort_all` stop requests on whichever rank holds them. The
    ranks must start within `args.distributed_startup_timeout` seconds; once running, a rank that
    sends no sign of life (it beats every second from a thread of its own) or makes no progress for
    `args.distributed_timeout` seconds is named in a TimeoutError, and a crashed rank in a
    RuntimeError, raised here; the engine is then closed. The ranks stop when the engine is closed,
    garbage-collected or the interpreter exits.
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.layout = args.layout
        self.world = args.world_size
        # One rank per data-parallel group reports its outputs and counters: the first of its
        # context-parallel ranks (the others run the same requests in lockstep).
        self._reporting = [self.layout.coords(r).cp_rank == 0 for r in range(self.world)]
        self.use_async = args.use_async
        self.timeout_s = float(args.distributed_timeout)
        self.startup_timeout_s = float(args.distributed_startup_timeout)
        self.model_path, self.is_default_model = resolve_model(args.model)
        if self.layout.cp > 1:  # refused here, before any rank starts, as each rank's runner would
            check_checkpoint_context_parallel(self.model_path, settings_from_env().enabled)
        tok_path = Path(args.tokenizer) if args.tokenizer else self.model_path
        self.tokenizer = load_tokenizer(tok_path)
        self.tokenizer_config = load_tokenizer_config(tok_path)
        self.stats = DataParallelStats()
        self._rank_stats: list[dict] = [{} for _ in range(self.world)]
        self._step_traces: list[list[dict]] = [[] for _ in range(self.world)]
        # front messages (add / abort) sent to each rank, and how many of them each rank's last
        # "idle" report (its run loop ended) covered: equal = the rank's counters are final
        self._sent = [0] * self.world
        self._settled = [0] * self.world
        self._seed_rng = random.Random(args.seed)
        self._pending: list[tuple] = []
        self._outstanding: set[str] = set()
        self._ready: deque[RequestOutput] = deque()
        # With `stream_outputs` on, the ranks also send each request's output so far after every step
        # that gave it tokens (`rank_streaming.py`); the latest one of each unfinished request is here.
        self.stream_outputs = False
        self.partial_outputs: dict[str, RequestOutput] = {}
        self._partial_arrived = False
        self._failed: str | None = None
        # Per rank: when the front last heard from it (any message, or a message sent to it while it
        # was idle: its silence starts then), and when it last made progress (its beats' counter moved,
        # or it sent outputs).
        now = time.monotonic()
        self._heard_at = [now] * self.world
        self._progress_at = [now] * self.world
        self._progress = [0] * self.world
        self._tokenizer_dir = tok_path
        self._structured = None  # StructuredOutputs, built on the first so_args request
        # requests with images are read and preprocessed here (as `LLM` / `AsyncLLM` ask `images`, or in
        # `add_request`), expanded and encoded by the rank that serves them
        self.images = ImagePreparer.for_checkpoint(self.model_path)
        self._dir = tempfile.mkdtemp(prefix="deepinfer-dp-")
        child_args = dataclasses.replace(args, model=str(self.model_path))
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        # Stops the ranks at close(), when the engine is collected, or at interpreter exit while every
        # module still works (a __del__ run late in the shutdown would find them torn down).
        self._finalizer = weakref.finalize(self, _stop_ranks, self._conns, self._procs, self._dir)
        try:
            with no_multicast_environment():  # NVLink multicast off in every rank
                for rank in range(self.world):
                    ours, theirs = ctx.Pipe()
                    p = ctx.Process(
                        target=_rank_main,
                        args=(
                            rank, self.world, os.path.join(self._dir, "rendezvous"), child_args, theirs,
                            self.startup_timeout_s, self.timeout_s,
                        ),
                        name=f"deepinfer-dp{rank}",
                        daemon=True,
                    )  # fmt: skip
                    p.start()
                    theirs.close()
                    self._conns.append(ours)
                    self._procs.append(p)
            info = self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.vocab_size = info["vocab_size"]
        self.max_model_len = info["max_model_len"]
        # the prefix index holds per rank no more blocks than the rank's cache
        num_blocks = int(info["stats"]["scheduler"]["num_blocks"])
        self.router = Router(  # over the data-parallel groups
            self.layout.dp,
            args.dp_routing,
            args.block_size,
            BalanceConfig(prefix_capacity_blocks=max(1, num_blocks)),
        )
        self._moves: dict[int, tuple[Move, int]] = {}  # per source group: the move asked, its message index
        self._aborted: set[str] = set()  # aborted while possibly on their way between groups
        self._group_of: dict[str, int] = {}  # outstanding request -> the group it was last sent to
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
        """Queue one request for the next `step()`. Raises ValueError for what one engine's
        `add_request` rejects before drawing the request's seeds (so the seed stream stays the
        single-process one); anything the rank rejects later comes back as that request's `error`.
        `multi_modal_data`: images, as `LLMEngine.add_request` takes them; read here (bad items fail
        here), expanded and encoded by the rank that serves the request."""
        self._check_usable()
        if request_id in self._outstanding or any(r[0] == request_id for r in self._pending):
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_prompt_logprobs(
            settings_from_env(), params.prompt_logprobs is not None
        )  # YoCo truncation refuses them
        validate_vocab_fields(params, self.vocab_size)
        # (a request with images: routed by its text and its images' blocks, `_cost`; a rank expands it)
        prompt_token_ids, images = self.front_request(prompt, prompt_token_ids, params, multi_modal_data)
        if params.so_args is not None:  # compiled here too: a bad grammar fails before any seed is drawn
            if self._structured is None:
                self._structured = StructuredOutputs(self._tokenizer_dir, self.vocab_size, self.eos_token_id)
            self._structured.new_state(params.so_args)
        seeds = front_seeds(self._seed_rng, params)  # (a sampled run does not depend on the ranks)
        self._pending.append((request_id, prompt, list(prompt_token_ids), params, seeds, images))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or bool(self._outstanding) or bool(self._ready)

    def get_num_unfinished_requests(self) -> int:
        return len(self._pending) + len(self._outstanding)

    def step(self) -> list[RequestOutput]:
        """Send the queued requests, then return the finished outputs that have arrived (waiting up to
        POLL_S seconds for the first one, or with `stream_outputs` for any news in `partial_outputs`)."""
        self._check_usable()
        if self._pending:
            self._dispatch()
        self._partial_arrived = False
        if not self._ready and self._outstanding:
            self._receive(until=lambda: bool(self._ready) or self._partial_arrived, max_wait_s=POLL_S)
        if not self._outstanding and self._settled != self._sent:
            # The last outputs are in: the ranks end their loops within a step. Wait for that, so
            # `stats` covers the whole run (the idle forwards and EPLB steps after a rank's last output).
            self._receive(until=lambda: self._settled == self._sent)
        done = list(self._ready)
        self._ready.clear()
        return done

    def abort_request(self, request_id: str) -> bool:
        """Stop one request, as `LLMEngine.abort_request`: False if the front does not hold it. A queued
        one ends here; a dispatched one on its rank, which frees its blocks. Its output (finish_reason
        "abort", or its normal end if it finished before the abort arrived) comes from `step()`."""
        self._check_usable()
        for i, req in enumerate(self._pending):
            if req[0] == request_id:
                del self._pending[i]
                self._ready.append(_aborted_output(req))
                return True
        if request_id not in self._outstanding:
            return False
        self._aborted.add(request_id)
        self._broadcast(("abort", [request_id]))
        return True

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request (queued ones never leave the front); returns their outputs."""
        done = list(self._ready)
        self._ready.clear()
        done += [_aborted_output(req) for req in self._pending]
        self._pending = []
        self.partial_outputs.clear()
        if self._outstanding and self._failed is None:
            self._aborted |= self._outstanding
            self._broadcast(("abort", None))
            self._receive(until=lambda: not self._outstanding)
            done += list(self._ready)
            self._ready.clear()
        return done

    def scheduler_stats(self) -> dict:
        """`LLMEngine.scheduler_stats()` summed over the data-parallel groups (their reporting ranks;
        kv_usage and prefix_cache_hit_rate recomputed from the sums), plus "ranks": each rank's own. As of each rank's last report: final
        once `step()` has returned the last outputs of a run, at most ~5 s old while one runs."""
        ranks = [dict(s.get("scheduler", {})) for s in self._rank_stats]
        total: dict = {}
        for stats in self._reported(ranks):
            for key, value in stats.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
        if total:
            total["kv_usage"] = (
                1.0 - total["num_free_blocks"] / total["num_blocks"] if total["num_blocks"] else 0.0
            )
            queried = total["prefix_cache_query_tokens"]
            total["prefix_cache_hit_rate"] = total["prefix_cache_hit_tokens"] / queried if queried else 0.0
        total["ranks"] = ranks
        return total

    def routed_rank(self, request_id: str) -> int | None:
        """The data-parallel group an outstanding request was last sent to (None once its output has
        arrived); without context parallelism a group is one rank, numbered as the rank."""
        return self._group_of.get(request_id)

    def routing_stats(self) -> dict:
        """What the front's router did since the engine started (`dp_balance.RoutingStats`): requests and
        tokens routed per data-parallel group (moved ones counted where they went), requests sent where
        the front had routed part of their prefix before, and the moves between groups; plus the policy."""
        return {"policy": self.router.policy, **dataclasses.asdict(self.router.stats)}

    def spec_counts(self) -> dict | None:
        """`LLMEngine.spec_counts()` summed over the data-parallel groups, as of each rank's last report (final once
        `step()` has returned a run's last outputs). None when no rank drafts."""
        counts = [s["spec_counts"] for s in self._reported(self._rank_stats) if s.get("spec_counts")]
        if not counts:
            return None
        total = {"nextn": max(c["nextn"] for c in counts)}
        for key in ("verified", "accepted"):
            total[key] = [sum(c[key][j] for c in counts if j < len(c[key])) for j in range(total["nextn"])]
        for key in ("request_steps", "draft_s"):
            total[key] = sum(c[key] for c in counts)
        total["steps"] = max(c["steps"] for c in counts)  # the ranks step in lockstep
        return total

    @property
    def num_speculative_tokens(self) -> int:
        counts = self.spec_counts()
        return 0 if counts is None else counts["nextn"]

    def start_step_trace(self) -> None:
        """From the ranks' next step on, each rank times its steps and reports them (`step_trace.py`);
        the records gathered so far are dropped. Benchmarks use it to report what the ranks ran."""
        self._check_usable()
        self._step_traces = [[] for _ in range(self.world)]
        self._broadcast(("trace", True))

    def stop_step_trace(self) -> None:
        self._check_usable()
        self._broadcast(("trace", False))

    def step_traces(self) -> list[dict]:
        """Per rank, in rank order: who ran (`identity`: rank, pid, host, EP group, EPLB on), the EPLB
        events it heard (`events`: kind -> count) and its step records since `start_step_trace`
        (`steps`: `StepRecord.as_dict()`). Complete once `step()` has returned a run's last outputs."""
        return [
            {
                "identity": dict(stats.get("identity", {})),
                "events": dict(stats.get("step_trace_events", {})),
                "steps": list(steps),
            }
            for stats, steps in zip(self._rank_stats, self._step_traces)
        ]

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and remove the rendezvous directory."""
        self._finalizer()
        if self._structured is not None:
            self._structured.close()
            self._structured = None
        if getattr(self, "images", None) is not None:
            self.images.close()
        if self._failed is None:
            self._failed = "the data-parallel engine is closed"

    # ------------------------------------------------------------------ internals
    def _dispatch(self) -> None:
        pending, self._pending = self._pending, []
        groups = self.router.route_batch([(req[2], self._cost(req)) for req in pending])
        shares = [[] for _ in range(self.layout.dp)]
        for req, g in zip(pending, groups):
            shares[g].append(req)
            self._outstanding.add(req[0])
            self._group_of[req[0]] = g
        # every rank, so every rank starts its loop; the ranks of a context-parallel group the same share
        for rank, conn in enumerate(self._conns):
            self._send(conn, ("add", shares[self._group(rank)], self.stream_outputs))
        for g in range(self.layout.dp):
            self.router.sent(g, self._sent_to_group(g))

    def _cost(self, req: tuple) -> int:
        """A request's load on a rank: its prompt (text, and each image's block once expanded) and budget."""
        prompt_len = len(req[2]) + (0 if req[5] is None else image_tokens(req[5][0]))
        return request_cost(prompt_len, req[3].max_tokens, req[3].n, self.max_model_len)

    def _group(self, rank: int) -> int:
        """The data-parallel group of `rank` (its context-parallel ranks are contiguous)."""
        return self.layout.coords(rank).dp_rank

    def _sent_to_group(self, group: int) -> int:
        """Front messages sent to each rank of `group` (its ranks get the same ones)."""
        return self._sent[group * self.layout.cp]

    def _send_to(self, group: int, msg: tuple, others: tuple) -> None:
        """`msg` to every rank of data-parallel `group` (its context-parallel ranks apply the same messages
        between the same steps, `rank_process.Inbox`); with expert or context parallelism `others` to every
        other rank too (the ranks of an EP group must take in the same number of messages,
        `DataParallelRank.agree`)."""
        for r, conn in enumerate(self._conns):
            if self._group(r) == group:
                self._send(conn, msg)
            elif self.args.expert_parallel_size > 1 or self.layout.cp > 1:
                self._send(conn, others)

    def _rebalance(self) -> None:
        """Ask an overloaded data-parallel group for waiting requests it has not started
        (`Router.plan_move`); each of its ranks withdraws the same ones (they hold the same requests)."""
        move = self.router.plan_move()
        if move is not None:
            self._send_to(move.src, ("release", move.src, move.budget_tokens), ("release", move.src, 0))
            self._moves[move.src] = (move, self._sent_to_group(move.src))

    def _on_released(self, group: int, reqs: list[tuple]) -> None:
        """A group handed back the requests of a move: on to the move's destination (an aborted one ends
        here, as it would have on its group)."""
        move, index = self._moves.pop(group)
        self.router.moved(move, index, [self._cost(req) for req in reqs])
        share = []
        for req in reqs:
            if req[0] in self._aborted:
                self._aborted.discard(req[0])
                self._outstanding.discard(req[0])
                self._group_of.pop(req[0], None)
                self._ready.append(_aborted_output(req))
            else:
                self.router.assign(move.dst, req[2], self._cost(req))
                self._group_of[req[0]] = move.dst
                share.append(req)
        if share:
            self._send_to(move.dst, ("add", share, self.stream_outputs), ("add", [], self.stream_outputs))
            self.router.sent(move.dst, self._sent_to_group(move.dst))

    def _broadcast(self, msg) -> None:
        for conn in self._conns:
            self._send(conn, msg)

    def _send(self, conn, msg) -> None:
        rank = self._conns.index(conn)
        if self._settled[rank] == self._sent[rank]:  # the rank was idle: its silence starts now
            self._heard_at[rank] = self._progress_at[rank] = time.monotonic()
        self._send_raw(conn, msg)
        self._sent[rank] += 1  # every message but close, which ends the rank

    def _send_raw(self, conn, msg) -> None:
        try:
            conn.send(msg)
        except OSError as e:
            rank = self._conns.index(conn)
            p = self._procs[rank]
            p.join(timeout=POLL_S)
            if p.exitcode is not None:
                self._fail(f"data-parallel rank {rank} exited with code {p.exitcode} ({e})")
            self._fail(f"data-parallel rank {rank} is unreachable ({e})")

    def _wait_ready(self) -> dict:
        ready: dict[int, dict] = {}

        def on_ready(msg):
            ready[msg[1]] = msg[2]
            self._rank_stats[msg[1]] = msg[2]["stats"]

        deadline = time.monotonic() + self.startup_timeout_s

        def started() -> bool:
            if len(ready) < self.world and time.monotonic() > deadline:
                late = [r for r in range(self.world) if r not in ready]
                self._fail(
                    f"data-parallel {_ranks(late)} not ready after {self.startup_timeout_s:.0f} s "
                    "(distributed_startup_timeout)",
                    TimeoutError,
                )
            return len(ready) == self.world

        self._receive(until=started, on_ready=on_ready, what="starting")
        return ready[0]

    def _receive(self, until, on_ready=None, what: str = "running", max_wait_s: float | None = None) -> None:
        """Handle rank messages until `until()` (or `max_wait_s` passed); raise on a dead rank, an
        error report, or a running rank silent or without progress for `distributed_timeout` s."""
        start = time.monotonic()
        while not until() and (max_wait_s is None or time.monotonic() - start < max_wait_s):
            ready = connection.wait(self._conns, timeout=POLL_S)
            for conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    continue  # the process is gone: its exit code is reported below
                rank, now = self._conns.index(conn), time.monotonic()
                self._heard_at[rank] = now
                kind = msg[0]
                if kind != "beat" or msg[2] != self._progress[rank]:
                    self._progress_at[rank] = now
                if kind == "beat":
                    self._progress[rank] = msg[2]
                elif kind == "error":
                    self._fail(f"data-parallel rank {msg[1]} failed while {what}:\n{msg[2]}")
                elif kind == "ready" and on_ready is not None:
                    on_ready(msg)
                elif kind == "load":  # from the first rank of a data-parallel group
                    self.router.report(self._group(msg[1]), msg[2])
                    self._rebalance()
                elif kind == "released":
                    self._on_released(self._group(msg[1]), msg[2])
                elif kind in ("outputs", "idle"):
                    self._step_traces[msg[1]] += msg[3].pop("step_trace", [])
                    self._rank_stats[msg[1]] = msg[3]
                    if kind == "idle":
                        self._settled[msg[1]] = msg[4]
                    self._update_stats()
                    for out in msg[2]:
                        self._outstanding.discard(out.request_id)
                        self._aborted.discard(out.request_id)
                        self._group_of.pop(out.request_id, None)
                        self.partial_outputs.pop(out.request_id, None)
                        self._ready.append(out)
                    for out in msg[4] if kind == "outputs" else ():
                        if out.request_id in self._outstanding:
                            self.partial_outputs[out.request_id] = out
                            self._partial_arrived = True
            for rank, p in enumerate(self._procs):
                if p.exitcode is not None:
                    self._fail(f"data-parallel rank {rank} exited with code {p.exitcode} while {what}")
            if what != "starting":
                self._check_running_ranks(what)

    def _check_running_ranks(self, what: str) -> None:
        """Fail naming the running ranks that sent nothing (frozen, or dead without exiting yet) or
        made no progress (alive, stuck: in a step, or in a collective waiting for a silent rank) for
        `distributed_timeout` seconds. A rank that has reported the end of its run is not watched."""
        now, limit = time.monotonic(), self.timeout_s
        running = [r for r in range(self.world) if self._settled[r] != self._sent[r]]
        silent = [r for r in running if now - self._heard_at[r] > limit]
        stuck = [r for r in running if r not in silent and now - self._progress_at[r] > limit]
        if not silent and not stuck:
            return
        parts = []
        if silent:
            quiet = max(now - self._heard_at[r] for r in silent)
            parts.append(f"data-parallel {_ranks(silent)} sent nothing for {quiet:.0f} s (frozen or hung)")
        if stuck:
            still = max(now - self._progress_at[r] for r in stuck)
            waiting = " (waiting for the silent rank)" if silent else " (stuck in a step or a collective)"
            parts.append(
                f"data-parallel {_ranks(stuck)} alive but made no progress for {still:.0f} s{waiting}"
            )
        self._fail(f"{'; '.join(parts)} while {what} (distributed_timeout={limit:.0f} s)", TimeoutError)

    def _reported(self, per_rank: list) -> list:
        """The entries of the reporting ranks (one per data-parallel group) of a per-rank list."""
        return [x for x, reports in zip(per_rank, self._reporting) if reports]

    def _update_stats(self) -> None:
        reported = self._reported(self._rank_stats)
        for name in ("steps",):  # steps run in lockstep: the slowest rank's count
            setattr(self.stats, name, max(s.get(name, 0) for s in reported))
        for f in dataclasses.fields(EngineStats):
            if f.name != "steps" and isinstance(getattr(self.stats, f.name), int | float):
                setattr(self.stats, f.name, sum(s.get(f.name, 0) for s in reported))
        # EPLB counters are per EP group (its ranks report the same ones): one report per group
        groups = [s for s in self._rank_stats if s.get("ep_rank") == 0]
        for f in dataclasses.fields(DataParallelStats):
            if f.name.startswith("eplb_") and groups:
                values = [s.get(f.name, 0) for s in groups]
                setattr(self.stats, f.name, sum(values) if f.name in _EPLB_SUMMED else max(values))

    def _fail(self, message: str, kind: type[Exception] = RuntimeError):
        self._failed = message
        self._kill()
        raise kind(message)

    def _kill(self) -> None:
        _kill(self._procs)

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"the data-parallel engine cannot be used: {self._failed}")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _aborted_output(req: tuple) -> RequestOutput:
    """The output of a request aborted before it left the front: as one engine reports a request
    aborted before its first step (each sample finished "abort", no tokens)."""
    rid, prompt, ids, params = req[:4]
    metrics = RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(ids))
    metrics.finish_time = metrics.arrival_time
    outputs = [CompletionOutput(index=i, finish_reason="abort") for i in range(params.n)]
    return RequestOutput(rid, prompt, list(ids), outputs, metrics)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def _stop_ranks(conns: list, procs: list, rendezvous_dir: str) -> None:
    """Ask the ranks to close, give them 10 s, then kill the rest; remove the rendezvous directory.
    The lists are the engine's own, emptied here, so a second call does nothing."""
    for conn, p in zip(conns, procs):
        if p.is_alive():
            with contextlib.suppress(OSError):
                conn.send(("close",))
    deadline = time.monotonic() + 10.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    _kill(procs)
    for conn in conns:
        conn.close()
    conns.clear()
    procs.clear()
    shutil.rmtree(rendezvous_dir, ignore_errors=True)


__all__ = ["DataParallelEngine", "DataParallelRank", "DataParallelStats", "assign_ranks"]
