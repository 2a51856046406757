"""`LLMEngine`: requests in, `RequestOutput`s out; owns the scheduler, the model worker and the loop.

One step (ARCHITECTURE.md): schedule -> runner forward -> sample -> scheduler.update_from_output ->
detokenize / stop strings -> outputs. Asynchronous ("zero-overhead") mode runs the model on a
worker thread: while step N runs, the main thread schedules step N+1 (the scheduler assumes every
running sequence emits its token and marks the ids it cannot know as -1) and queues it behind N;
the worker fills those ids from the tokens it sampled in N (`prev_rows`), on the device: N+1 is
launched before N's tokens are read back (`step_pipeline.py`), so the device runs N+1 right behind N
(DEEPINFER_ASYNC_DEVICE_INPUTS=0: filled on the host once N is read). The host then commits N
(`update_from_output`) and detokenizes it while N+1 runs. Steps with structured-output rows instead
wait for N, `reconcile`, and launch (their grammar masks need N's tokens). The sampler's draw
depends only on (seed, position), and a runner's logits only on the sequence (the paged runner is
bitwise equal to the stateless forward), so both loops emit the same tokens.

Speculative decoding (DSpark drafts; `spec_decode.py`) runs the synchronous loop: a step's drafts
come from the drafter after the previous step's verification on the host, so there is nothing
to overlap yet (a device-side draft path would change that); with `async_scheduling` and drafts on, `step()` runs the
synchronous step (same tokens by construction).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from deepinfer_model import load_model
from deepinfer_model.runtime import make_runner
from deepinfer_model.runtime.cuda_graphs import decode_graph_settings
from deepinfer_model.sampling import RowParams
from deepinfer_spec import MAX_NEXTN, StepTimeCurve

from .. import envs
from ..default_model import resolve_model
from ..engine_args import EngineArgs
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer import load_tokenizer, load_tokenizer_config
from . import scheduling
from .device_timing import StepTiming, device_timeline
from .drafting import Drafter, DraftRequest, ModelDrafter, PagedDrafter
from .request import RequestState, SeqState
from .spec_decode import SpecDecoder, VerifyInput
from .step_pipeline import StepPipeline
from .structured import StructuredOutputs
from .truncation import Truncation, settings_from_env
from .worker import ModelWorker, StepResult, VerifyStepResult

if TYPE_CHECKING:
    from .dp_rank import DataParallelRank

logger = logging.getLogger("deepinfer")

DEVICE_TIMINGS_KEPT = (
    65536  # per-step device timings an engine keeps (a long-running server's memory stays bounded)
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class EngineStats:
    steps: int = 0
    schedule_s: float = 0.0  # main-thread time in Scheduler.schedule()
    hidden_schedule_s: float = 0.0  # of which ran while the worker was busy with the previous step
    prepare_s: float = 0.0  # reconcile + runner batch + sampler rows + grammar masks
    hidden_prepare_s: float = 0.0  # of which ran while the worker was busy
    forward_s: float = 0.0
    sample_s: float = 0.0
    process_s: float = 0.0  # update_from_output + detokenization + stop handling
    hidden_process_s: float = 0.0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    draft_s: float = 0.0  # drafter time (speculative decoding)
    # Estimated FP8-equivalent FLOPs of all prefill chunks run (V4.1 models; YoCo-skipped rows excluded).
    prefill_flops: float = 0.0
    # Device timing from CUDA events (device_timing.py): each step's span on the device and the idle
    # gap before it (previous step's end -> its start; not measured for the first step after the
    # engine was idle). Read lazily, so the newest steps arrive a step late (`flush_device_timing()`
    # waits for all). On the CPU nothing is recorded: these stay 0 / empty.
    device_steps: int = 0  # steps timed
    device_busy_s: float = 0.0  # sum of their spans
    device_busy_max_s: float = 0.0
    device_gaps: int = 0  # steps with a measured gap before them
    device_idle_gap_s: float = 0.0  # sum of those gaps
    device_idle_gap_max_s: float = 0.0
    # the last DEVICE_TIMINGS_KEPT steps, oldest first, for percentiles (summarize_timings)
    device_timings: deque[StepTiming] = field(default_factory=lambda: deque(maxlen=DEVICE_TIMINGS_KEPT))

    def add_device_timing(self, t: StepTiming) -> None:
        self.device_steps += 1
        self.device_busy_s += t.busy_s
        self.device_busy_max_s = max(self.device_busy_max_s, t.busy_s)
        if t.gap_s is not None:
            self.device_gaps += 1
            self.device_idle_gap_s += t.gap_s
            self.device_idle_gap_max_s = max(self.device_idle_gap_max_s, t.gap_s)
        self.device_timings.append(t)


class LLMEngine:
    def __init__(
        self,
        args: EngineArgs,
        *,
        num_speculative_tokens: int | None = None,
        drafter: Drafter | None = None,
        step_time_curve: StepTimeCurve | str | Path | None = None,
        dp: DataParallelRank | None = None,
    ) -> None:
        """num_speculative_tokens: drafts per step (None: DEEPINFER_USE_NEXTN_DECODE, default 5; 0 = off);
        drafter: who proposes them (default: the checkpoint's DSpark draft blocks); step_time_curve:
        for DEEPINFER_ENABLE_MTP_VARLEN=1, a StepTimeCurve or its JSON file (default: measured now);
        dp: this engine is one rank of a data-parallel world (data_parallel.py): its model's experts
        are sharded over the EP group and every step starts with the ranks' vote."""
        envs.warn_unknown()
        self.args = args
        self.dp = dp
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.model_path, self.is_default_model = resolve_model(args.model)
        tok_path = Path(args.tokenizer) if args.tokenizer else self.model_path
        self.tokenizer = load_tokenizer(tok_path)
        self.tokenizer_config = load_tokenizer_config(tok_path)
        self.device = args.torch_device
        if dp is not None:  # only this rank's experts
            self.model = dp.load_model(self.model_path, _DTYPES[args.dtype], self.device)
        elif (
            self.device.type == "cpu"
        ):  # the two-argument call: wrappers of load_model(path, dtype) keep working
            self.model = load_model(self.model_path, _DTYPES[args.dtype])
        else:  # weights go to the device in their stored format and are dequantised there
            self.model = load_model(self.model_path, _DTYPES[args.dtype], device=self.device)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        raw_config = json.loads((self.model_path / "config.json").read_text())
        text_config = raw_config.get("text_config", {})
        self.eos_token_id = _int_or_none(raw_config.get("eos_token_id", text_config.get("eos_token_id")))
        self.bos_token_id = _int_or_none(raw_config.get("bos_token_id", text_config.get("bos_token_id")))
        model_limit = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
        self.max_model_len = min(args.max_model_len or 4096, model_limit)
        if args.max_model_len and args.max_model_len > model_limit:
            raise ValueError(f"max_model_len must be <= the model's max_position_embeddings ({model_limit})")
        self.max_num_batched_tokens = args.max_num_batched_tokens or max(self.max_model_len, 4096)
        nextn = self._resolve_nextn(num_speculative_tokens, drafter)
        if dp is not None:  # a forward carries at most the token budget, or every sequence's verify rows
            dp.attach_deepep(
                max(self.max_num_batched_tokens, args.max_num_seqs * (1 + nextn)), envs.DEEPINFER_EP_BACKEND
            )
        # YoCo truncation: checked here (V4.1 split, KEEP >= W + B) before anything is allocated.
        self.truncation = Truncation(settings_from_env(), self.model, nextn)
        blocks_per_seq = -(-self.max_model_len // args.block_size)
        num_blocks = args.num_kv_blocks or blocks_per_seq * min(args.max_num_seqs, 64) + 1
        self.scheduler = scheduling.make_scheduler(
            block_size=args.block_size,
            num_blocks=num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            chunked_prefill=args.chunked_prefill,
            num_speculative_tokens=nextn,
        )
        yoco = self.truncation.settings if self.truncation.enabled else None
        self.runner = make_runner(
            args.runner,
            self.model,
            num_blocks=num_blocks,
            block_size=args.block_size,
            yoco=yoco,
            backtracking=self.truncation.backtracking,
            # decode / verification CUDA graphs (CUDA only): buckets up to max_num_seqs x (1 + nextn)
            # tokens; the drafter itself runs eagerly
            decode_graphs=decode_graph_settings(
                self.device,
                args.max_num_seqs,
                self.max_model_len,
                # expert parallel: the all-to-alls have host-side split sizes, nothing to capture
                enforce_eager=envs.DEEPINFER_ENFORCE_EAGER or (dp is not None and dp.ep_size > 1),
                interval=envs.DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL,
                capture_all=envs.DEEPINFER_CUDAGRAPH_CAPTURE_ALL,
                batch_invariant=envs.DEEPINFER_CUDAGRAPH_BATCH_INVARIANT,
                draft=envs.DEEPINFER_CUDAGRAPH_DRAFT,
                compile=envs.DEEPINFER_CUDAGRAPH_COMPILE,
                nextn=nextn,
            ),
        )
        self._prompt_len_of: dict[int, int] = {}  # seq_id -> ORIGINAL prompt length, until released
        self.worker = ModelWorker(
            self.runner,
            timeline=device_timeline(self.device),
            collectives=dp.collectives if dp is not None else None,
        )
        self.use_async = args.use_async
        self._pool = (
            StepPipeline(
                self.worker,
                # OpenMP thread counts and the current CUDA device are per thread: give the worker
                # the caller's (a DP rank's collectives run on this thread, on its own GPU).
                initializer=_init_worker_thread,
                initargs=(torch.get_num_threads(), self.device),
            )
            if self.use_async
            else None
        )
        # Steps launched on the worker and not yet committed, oldest first (at most two: the one
        # running and the one queued behind it).
        self._inflight: deque[tuple[object, Future]] = deque()
        self._seed_rng = random.Random(args.seed)
        self._blacklist = tuple(envs.parse_token_ranges(envs.DEEPINFER_DECODE_TOKEN_BLACKLIST))
        self._next_seq_id = 0
        self.requests: dict[str, RequestState] = {}
        self.seqs: dict[int, SeqState] = {}
        self._done: list[RequestOutput] = []
        # Finished sequences are forgotten by the scheduler one step late: under async scheduling the
        # step in flight may still name them.
        self._pending_release: list[int] = []
        self.stats = EngineStats()
        self._tokenizer_dir = tok_path
        self._structured: StructuredOutputs | None = None  # built on the first so_args request
        # Grammar masks are filled here while the forward runs (xgrammar releases the GIL; the masks
        # are needed only at sampling), so their cost leaves the step's critical path.
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-masks")
        self._spec: SpecDecoder | None = None
        if nextn:
            curve = self._step_time_curve(step_time_curve, nextn)
            if drafter is None:
                paged = hasattr(self.runner, "last_step_index")
                drafter = PagedDrafter(self.runner, self.model) if paged else ModelDrafter(self.model)
            self._spec = SpecDecoder(nextn, drafter, curve)

    def _resolve_nextn(self, requested: int | None, drafter: Drafter | None) -> int:
        if requested is None and self.is_default_model and not envs.is_set("DEEPINFER_USE_NEXTN_DECODE"):
            # deepinfer-tiny's weights are random: its drafts are (almost) never accepted, so drafting
            # would only slow the demo down (measured 2.5x). Real checkpoints get the reference's 5.
            logger.info("deepinfer-tiny has random weights: speculative decoding off unless asked for")
            return 0
        nextn = int(envs.DEEPINFER_USE_NEXTN_DECODE) if requested is None else requested
        if isinstance(nextn, bool) or not 0 <= nextn <= MAX_NEXTN:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_NEXTN}], got {nextn!r}")
        if (
            nextn
            and drafter is None
            and getattr(getattr(self.model, "weights", None), "drafter", None) is None
        ):
            # The env var is a process-wide default: models without draft blocks just decode plainly.
            log = logger.debug if requested is None else logger.warning
            log("speculative decoding off: the checkpoint has no DSpark draft blocks")
            return 0
        return nextn

    def _step_time_curve(self, given, nextn: int) -> StepTimeCurve | None:
        """The varlen rule's step-time curve: given / loaded from a file / measured on the model now."""
        if not envs.DEEPINFER_ENABLE_MTP_VARLEN:
            return None
        if isinstance(given, StepTimeCurve):
            return given
        if given is not None:
            return StepTimeCurve.load(given)
        max_tokens = min(self.args.max_num_seqs * (1 + nextn), 64)
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_tokens} & set(range(1, max_tokens + 1)))
        ids = torch.arange(max_tokens) % self.vocab_size

        def step(n: int) -> None:  # one forward over n query tokens: the step's cost grows with them
            self.model.forward(ids[:n])

        logger.info("measuring the decode step-time curve for MTP varlen (%d sizes)", len(sizes))
        return StepTimeCurve.measure(step, sizes, repeats=3, mode="linear")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens; it must be shorter than max_model_len={self.max_model_len}"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        seeds: list[int] | None = None,
    ) -> None:
        """Queue one request; raises ValueError (naming the problem) without touching other requests.
        seeds: the n samples' seeds when params.seq_seed is None (a data-parallel front draws them
        from one stream for all ranks); default: from this engine's seed stream."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.truncation.check_request(params.prompt_logprobs)
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("either prompt or prompt_token_ids must be given")
            prompt_token_ids = self.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate_prompt(prompt_token_ids)
        grammars = [None] * params.n
        if params.so_args is not None:
            if self._structured is None:
                self._structured = StructuredOutputs(self._tokenizer_dir, self.vocab_size, self.eos_token_id)
            grammars = [self._structured.new_state(params.so_args) for _ in range(params.n)]
        if seeds is None or params.seq_seed is not None:
            seeds = [
                (params.seq_seed + i) & (2**64 - 1)
                if params.seq_seed is not None
                else self._seed_rng.getrandbits(64)
                for i in range(params.n)
            ]
        elif len(seeds) != params.n:
            raise ValueError(f"seeds has {len(seeds)} entries for n={params.n} samples")
        seq_ids = list(range(self._next_seq_id, self._next_seq_id + params.n))
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, self.tokenizer, seq_ids, seeds, arrival_time
        )
        for seq, grammar in zip(state.seqs, grammars):
            seq.grammar = grammar
            if self._spec is not None:
                self._spec.add(seq.seq_id, seq.seed)
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        self._next_seq_id += params.n
        if self.worker.timeline is not None and not self.requests and not self._inflight:
            # the device sat idle for want of requests, not because of the loop: no gap before the next step
            self.worker.timeline.break_chain()
        added: list[int] = []
        try:
            for seq in state.seqs:
                scheduling.add_sequence(
                    self.scheduler,
                    seq.seq_id,
                    prompt_token_ids,
                    params,
                    self.eos_token_id,
                    max_tokens,
                    cache_salt=self.truncation.cache_salt(len(prompt_token_ids)),
                )
                added.append(seq.seq_id)
                self._prompt_len_of[seq.seq_id] = len(prompt_token_ids)
        except ValueError:  # leave nothing of this request behind in the scheduler
            for seq_id in added:
                scheduling.abort(self.scheduler, seq_id)
                self._pending_release.append(seq_id)
            if self._spec is not None:
                for seq in state.seqs:
                    self._spec.remove(seq.seq_id)
            raise
        self.requests[request_id] = state
        for seq in state.seqs:
            self.seqs[seq.seq_id] = seq
        self.stats.prompt_tokens += len(prompt_token_ids) * params.n

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its blocks are freed. Its output (finish_reason "abort") is returned by step()."""
        state = self.requests.get(request_id)
        if state is None:
            return False
        for seq in state.seqs:
            if not seq.finished:
                scheduling.abort(self.scheduler, seq.seq_id)
                seq.finish("abort")
        self._collect(state)
        return True

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request and settle the step in flight (Ctrl-C path); returns their outputs."""
        for request_id in list(self.requests):
            self.abort_request(request_id)
        while self._inflight:
            out, future = self._inflight.popleft()
            self._commit(out, future.result())
        self._release_idle()
        done, self._done = self._done, []
        return done

    def fail_request(self, request_id: str, message: str) -> None:
        state = self.requests[request_id]
        for seq in state.seqs:
            if not seq.finished:
                scheduling.abort(self.scheduler, seq.seq_id)
                seq.finish("error")
        state.error = message
        self._collect(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._inflight) or bool(self._done)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Advance by one model step; returns the requests that finished in it."""
        if self._spec is not None:
            self._step_spec()
        elif self.use_async:
            self._step_async()
        else:
            self._step_sync()
        if self.worker.timeline is not None:  # non-blocking: steps whose end events have completed
            for t in self.worker.timeline.drain():
                self.stats.add_device_timing(t)
        if not self.args.disable_log_stats:
            self._maybe_log_stats()
        done, self._done = self._done, []
        return done

    def flush_device_timing(self) -> None:
        """Wait for the device timing of every step launched so far and add it to `stats` (the end
        of a measured run; step() only collects what has completed). No-op on the CPU."""
        if self.worker.timeline is not None:
            for t in self.worker.timeline.drain(wait=True):
                self.stats.add_device_timing(t)

    def _maybe_log_stats(self) -> None:
        interval = envs.DEEPINFER_LOGGING_INTERVAL_STEP
        if interval <= 0 or self.stats.steps == 0 or self.stats.steps % interval:
            return
        s = scheduling.stats(self.scheduler)
        logger.info(
            "step %d: running %d waiting %d, KV usage %.1f%%, prefix-cache hit rate %.1f%%, preemptions %d, "
            "generated %d tokens, prefill %.3g FLOP (est.)",
            self.stats.steps,
            s["num_running"],
            s["num_waiting"],
            100 * s["kv_usage"],
            100 * s["prefix_cache_hit_rate"],
            s["num_preemptions"],
            self.stats.generated_tokens,
            self.stats.prefill_flops,
        )

    def _schedule(self):
        t0 = time.perf_counter()
        out = scheduling.schedule(self.scheduler)
        return out, time.perf_counter() - t0

    def _step_sync(self) -> None:
        out, dt = self._schedule()
        self.stats.schedule_s += dt
        self._dp_agree(launching=0 if scheduling.is_empty(out) else 1, inline=True)
        if scheduling.is_empty(out):
            scheduling.retire(self.scheduler, out)
            self._release_idle()
            return
        t0 = time.perf_counter()
        batch, rows, golden, allowed, prompt_lens = self._prepare(out)
        self.stats.prepare_s += time.perf_counter() - t0
        is_prompt = bool(scheduling.is_prefill(out).any())  # EPLB's prefill-step flag (data parallel)
        result = self.worker.run(batch, rows, golden, allowed, prompt_lens=prompt_lens, is_prompt=is_prompt)
        self._process(out, result)

    def _step_async(self) -> None:
        """One step of the asynchronous loop (see the module docstring)."""
        if not self._inflight:
            out, dt = self._schedule()
            self.stats.schedule_s += dt
            if scheduling.is_empty(out):
                scheduling.retire(self.scheduler, out)
                self._release_idle()
                self._dp_agree()
                return
            self._launch(out)
        out, future = self._inflight[0]
        # Step N runs on the worker; schedule N+1 meanwhile.
        nxt, dt = self._schedule()
        self.stats.schedule_s += dt
        if not future.done():
            self.stats.hidden_schedule_s += dt
        # A sequence preempted by this schedule while step N was in flight gets N's token dropped
        # by the scheduler (it will recompute it); the engine must drop it too.
        preempted = set(scheduling.preempted(nxt))
        if scheduling.is_empty(nxt):
            scheduling.retire(self.scheduler, nxt)
            nxt = None
        elif not self._needs_reconcile(nxt):
            # Queue N+1 behind N now: the worker fills its unknown input ids from N's tokens
            # (prev_rows), so the model never waits for the host.
            t0 = time.perf_counter()
            self._launch(nxt, fill_from_previous=True)
            dt = time.perf_counter() - t0
            self.stats.prepare_s += dt
            if not future.done():
                self.stats.hidden_prepare_s += dt
            nxt = None
        self._dp_agree()  # before waiting: the other ranks join step N's all-to-alls only after it
        result: StepResult = future.result()
        self._inflight.popleft()
        t0 = time.perf_counter()
        finished = self._commit(out, result, preempted)
        t1 = time.perf_counter()
        self.stats.process_s += t1 - t0
        if self._inflight and not self._inflight[0][1].done():
            self.stats.hidden_process_s += t1 - t0
        if nxt is not None:  # structured rows: their masks need N's tokens, so reconcile on the host
            nxt = scheduling.reconcile(self.scheduler, nxt)
            if scheduling.is_empty(nxt):
                scheduling.retire(self.scheduler, nxt)
            else:
                self._launch(nxt)
            self.stats.prepare_s += time.perf_counter() - t1
        # Detokenize N's tokens while N+1 runs.
        t0 = time.perf_counter()
        self._emit(out, result, finished, preempted)
        dt = time.perf_counter() - t0
        self.stats.process_s += dt
        if self._inflight and not self._inflight[0][1].done():
            self.stats.hidden_process_s += dt
        self._collect_all()

    def _needs_reconcile(self, out) -> bool:
        """Grammar masks are built from the state after the previous step: such steps wait for it."""
        return any(
            (seq := self.seqs.get(seq_id)) is not None and seq.grammar is not None
            for seq_id in scheduling.seq_ids(out).tolist()
        )

    def _launch(self, out, fill_from_previous: bool = False) -> None:
        batch, rows, golden, allowed, prompt_lens = self._prepare(out, allow_unknown=fill_from_previous)
        prev_rows = scheduling.prev_rows(out) if fill_from_previous else None
        is_prompt = bool(scheduling.is_prefill(out).any())  # EPLB's prefill-step flag (data parallel)
        future = self._pool.submit_step(
            (batch, rows, golden, allowed, prev_rows, prompt_lens, is_prompt), chain=fill_from_previous
        )
        self._inflight.append((out, future))
        if self.dp is not None:
            self.dp.launched += 1

    def _dp_agree(self, launching: int = 0, inline: bool = False) -> None:
        """Data parallel: the step's vote with the other ranks (DataParallelRank.agree). Exactly one
        per step() call on every rank, before anything waits for a forward. `launching`: forwards
        this step runs inline after the vote (sync loop); idle forwards to catch up with the other
        ranks run inline (sync loop) or queue behind the launched ones on the worker thread (async)."""
        if self.dp is None:
            return
        self.dp.agree(
            busy=bool(self.requests) or bool(self._inflight),
            launching=launching,
            idle_inline=inline,
            run_idle=self.worker.idle,
            submit_idle=None if inline else (lambda: self._pool.submit(self.worker.idle)),
        )

    def _prepare(self, out, allow_unknown: bool = False):
        batch = scheduling.to_runner_batch(out, allow_unknown)
        emits = scheduling.emits_tokens(out)
        rows: list[RowParams | None] = []
        golden: list[int | None] = []
        grammar_rows: dict[int, object] = {}
        for i, seq_id in enumerate(batch.seq_ids.tolist()):
            seq = self.seqs.get(seq_id)
            if not emits[i] or seq is None:
                rows.append(None)
                golden.append(None)
                continue
            p = seq.request.params
            position = int(batch.start_positions[i] + batch.query_lens[i])  # index of the token produced
            generated_before = position - len(seq.request.prompt_token_ids)
            rows.append(
                RowParams(
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    min_p=p.min_p,
                    seed=seq.seed,
                    position=position,
                    logprobs=p.logprobs,
                    banned_token_ids=self._banned(seq, generated_before),
                )
            )
            g = p.golden_token_ids
            golden.append(g[generated_before] if g is not None and generated_before < len(g) else None)
            if seq.grammar is not None:
                grammar_rows[i] = seq.grammar
        allowed = None
        if grammar_rows:  # a callable the worker resolves after the forward (filled meanwhile)
            allowed = self._mask_pool.submit(self._structured.allowed_rows, grammar_rows, len(rows)).result
        return batch, rows, golden, allowed, self._step_prompt_lens(out, batch)

    def _step_prompt_lens(self, out, batch) -> list[int] | None:
        """The step's prompt lengths for the runner (None unless truncating); adds its prefill FLOPs."""
        self.stats.prefill_flops += self.truncation.step_flops(
            batch, scheduling.is_prefill(out), self._prompt_len_of
        )
        return self.truncation.prompt_lens(batch.seq_ids, self._prompt_len_of)

    def _banned(self, seq: SeqState, generated_before: int) -> tuple[int, ...]:
        p = seq.request.params
        banned = list(self._blacklist)
        if generated_before < p.min_tokens or (p.first_n_token_no_eos == 1 and generated_before == 0):
            if self.eos_token_id is not None and not p.ignore_eos:
                banned.append(self.eos_token_id)
        if generated_before < p.min_tokens:
            banned.extend(p.stop_token_ids)
        return tuple(banned)

    def _commit(self, out, result: StepResult, preempted: set[int] = frozenset()) -> dict[int, str]:
        """Tell the scheduler what the step produced; returns {seq_id: scheduler finish reason}.

        Grammar states advance here (not in `_emit`) because the next step's masks are built from
        them before `_emit` runs under asynchronous scheduling.
        """
        for i in result.errors:
            seq_id = int(scheduling.seq_ids(out)[i])
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.request.request_id in self.requests:
                self.fail_request(seq.request.request_id, result.errors[i])
        tokens = result.tokens.copy()
        tokens[list(result.errors)] = -1
        releasable, self._pending_release = self._pending_release, []
        finished = scheduling.update_from_output(self.scheduler, out, tokens)
        for seq_id in releasable:
            self._release(seq_id)
        if self._structured is not None:
            for i, seq_id in enumerate(scheduling.seq_ids(out).tolist()):
                seq = self.seqs.get(seq_id)
                token = int(tokens[i])
                if seq is None or seq.grammar is None or seq.finished or token < 0:
                    continue
                if seq_id in preempted and seq.grammar.num_tokens >= scheduling.num_output_tokens(
                    self.scheduler, seq_id
                ):
                    continue  # dropped by the scheduler; the recompute produces it again
                try:
                    self._structured.accept(seq.grammar, token)
                except ValueError as e:
                    result.errors[i] = f"structured output: {e}"
                    self.fail_request(seq.request.request_id, result.errors[i])
        return finished

    def _emit(
        self, out, result: StepResult, finished: dict[int, str], preempted: set[int] = frozenset()
    ) -> None:
        for i, seq_id in enumerate(scheduling.seq_ids(out).tolist()):
            token = int(result.tokens[i])
            seq = self.seqs.get(seq_id)
            if seq is None or seq.finished or token < 0 or i in result.errors:
                continue
            if seq_id in preempted and seq.num_generated >= scheduling.num_output_tokens(
                self.scheduler, seq_id
            ):
                continue  # the scheduler dropped this token; recompute will produce it again
            seq.append(token, self.eos_token_id, self.max_model_len, result.logprobs[i], result.top[i])
            self.stats.generated_tokens += 1
            if seq.finished:
                # Ended here by a stop string / stop token: the scheduler may not know yet.
                if seq_id not in finished:
                    scheduling.abort(self.scheduler, seq_id)
            elif seq_id in finished:
                seq.finish(_REASONS.get(finished[seq_id], finished[seq_id]))
        self.stats.steps += 1
        self.stats.forward_s += result.forward_s
        self.stats.sample_s += result.sample_s

    def _process(self, out, result: StepResult) -> None:
        t0 = time.perf_counter()
        finished = self._commit(out, result)
        self._emit(out, result, finished)
        self.stats.process_s += time.perf_counter() - t0
        self._collect_all()

    def _collect(self, state: RequestState) -> None:
        if state.finished and self.requests.pop(state.request_id, None) is not None:
            for seq in state.seqs:
                self.seqs.pop(seq.seq_id, None)
                self._pending_release.append(seq.seq_id)
                if self._spec is not None:
                    self._spec.remove(seq.seq_id)
            self._done.append(state.to_output())

    def _release_idle(self) -> None:
        self._collect_all()
        if not self._inflight:
            for seq_id in self._pending_release:
                self._release(seq_id)
            self._pending_release = []

    def _release(self, seq_id: int) -> None:
        scheduling.release(self.scheduler, seq_id)
        self._prompt_len_of.pop(seq_id, None)

    def _collect_all(self) -> None:
        for state in [s for s in self.requests.values() if s.finished]:
            self._collect(state)

    def close(self) -> None:
        while self._inflight:
            _, future = self._inflight.popleft()
            try:
                future.result()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._mask_pool.shutdown(wait=True)
        if self._structured is not None:
            self._structured.close()
            self._structured = None
        runner_close = getattr(self.runner, "close", None)  # decode CUDA graphs (before process groups)
        if runner_close is not None:
            runner_close()

    def scheduler_stats(self) -> dict:
        return scheduling.stats(self.scheduler)

    def spec_stats(self) -> dict | None:
        """Speculative-decoding accounting (SpecStats.summary() + nextn, varlen, drafter seconds);
        None when drafting is off. Throughput keys use the decode steps' forward + sample + draft time."""
        return None if self._spec is None else self._spec.summary()

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self._spec is None else self._spec.nextn

    # ------------------------------------------------------------------ speculative decoding
    def _step_spec(self) -> None:
        out, dt = self._schedule()
        self.stats.schedule_s += dt
        for seq_id in scheduling.preempted(out):
            self._spec.discard(seq_id)
        self._dp_agree(launching=0 if scheduling.is_empty(out) else 1, inline=True)
        if scheduling.is_empty(out):
            scheduling.retire(self.scheduler, out)
            self._release_idle()
            return
        t0 = time.perf_counter()
        batch, inputs, allowed, confs = self._prepare_verify(out)
        prompt_lens = self._step_prompt_lens(out, batch)
        self.stats.prepare_s += time.perf_counter() - t0
        result = self.worker.run_verify(
            batch, inputs, allowed, self._spec.verifier, prompt_lens, bool(scheduling.is_prefill(out).any())
        )
        t0 = time.perf_counter()
        self._process_verify(out, batch, inputs, confs, result)
        self.stats.process_s += time.perf_counter() - t0
        self._collect_all()

    def _row_params(self, seq: SeqState, position: int) -> RowParams:
        p = seq.request.params
        return RowParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=seq.seed,
            position=position,
            logprobs=p.logprobs,
            banned_token_ids=self._banned(seq, position - len(seq.request.prompt_token_ids)),
        )

    def _prepare_verify(self, out):
        """Runner batch with 1 + k logits rows per verifying sequence, a VerifyInput per emitting
        sequence (None otherwise), grammar masks per packed row, confidences of the fed drafts."""
        batch = scheduling.to_verify_batch(out)
        ks = scheduling.num_draft_tokens(out)
        inputs: list[VerifyInput | None] = []
        grammar_reqs, confs, packed = [], [], 0
        for i, seq_id in enumerate(batch.seq_ids.tolist()):
            n, k = int(batch.logits_lens[i]), int(ks[i])
            seq = self.seqs.get(seq_id)
            if n == 0 or seq is None:
                inputs.append(None)
                continue
            if n != 1 + k:
                raise RuntimeError(f"sequence {seq_id}: {n} logits rows for {k} drafts")
            drafts, probs, c = self._spec.pending(seq_id, k) if k else ([], None, [])
            first = int(batch.query_offsets[i]) + 1
            if drafts != batch.input_ids[first : first + k].tolist():
                raise RuntimeError(f"sequence {seq_id}: the scheduler fed other drafts than were proposed")
            base = int(batch.start_positions[i] + batch.query_lens[i]) - k  # row 0's token position
            prompt_len = len(seq.request.prompt_token_ids)
            g = seq.request.params.golden_token_ids
            golden = [
                g[base + j - prompt_len] if g is not None and base + j - prompt_len < len(g) else -1
                for j in range(1 + k)
            ]
            rows = [self._row_params(seq, base + j) for j in range(1 + k)]
            inputs.append(VerifyInput(rows, drafts, probs, golden))
            confs.extend(c)
            if seq.grammar is not None:
                grammar_reqs.append((seq.grammar, packed, drafts))
            packed += n
        allowed = self._structured.allowed_rows_with_drafts(grammar_reqs, packed) if grammar_reqs else None
        return batch, inputs, allowed, confs

    def _stop_cut(self, seq: SeqState, tokens: list[int]) -> list[int]:
        """Tokens after a stop token are never emitted (the scheduler would drop them too)."""
        p = seq.request.params
        for j, t in enumerate(tokens):
            if (t == self.eos_token_id and not p.ignore_eos) or t in p.stop_token_ids:
                return tokens[: j + 1]
        return tokens

    def _process_verify(self, out, batch, inputs, confs, result: VerifyStepResult) -> None:
        ids = batch.seq_ids.tolist()
        for i, message in result.errors.items():
            seq = self.seqs.get(ids[i])
            if seq is not None and seq.request.request_id in self.requests:
                self.fail_request(seq.request.request_id, message)
        emitted: list[list[int]] = [[] for _ in ids]
        outcome = result.outcome
        if outcome is not None:
            for idx, i in enumerate(result.verified):
                seq = self.seqs.get(ids[i])
                if seq is not None and not seq.finished:
                    emitted[i] = self._stop_cut(seq, outcome.result.emitted[idx])
        releasable, self._pending_release = self._pending_release, []
        finished = scheduling.update_from_lists(self.scheduler, out, emitted)
        for seq_id in releasable:
            self._release(seq_id)
        accepted_after: dict[int, int] = {}
        if outcome is not None:
            prefill = scheduling.is_prefill(out)
            vids = [ids[i] for i in result.verified]
            decode = [not bool(prefill[i]) for i in result.verified]
            rollbacks = self._spec.commit(vids, outcome.result, decode, confs)
            # The runner forgets the rejected rows; the scheduler already did (num_computed_tokens).
            self.worker.rollback([(rb.seq_id, rb.num_discarded) for rb in rollbacks])
            for rb, i in zip(rollbacks, result.verified):
                accepted_after[i] = rb.num_accepted
                seq = self.seqs.get(ids[i])
                if seq is not None:
                    seq.request.metrics.num_draft_tokens += rb.num_verified
                    seq.request.metrics.num_accepted_draft_tokens += rb.num_accepted
        self._emit_verified(out, ids, emitted, outcome, result, finished)
        decode_seqs = sum(1 for x in inputs if x is not None)
        self._spec.update_runtime(int(batch.query_lens.sum()), result.forward_s, decode_seqs, result.sample_s)
        self._propose_drafts(ids, inputs, accepted_after, finished)

    def _emit_verified(self, out, ids, emitted, outcome, result: VerifyStepResult, finished) -> None:
        where = {i: idx for idx, i in enumerate(result.verified)}
        for i, seq_id in enumerate(ids):
            seq = self.seqs.get(seq_id)
            tokens = emitted[i]
            if seq is None or seq.finished or not tokens:
                continue
            if seq.grammar is not None and self._structured is not None:
                try:
                    self._structured.accept_many(seq.grammar, tokens)
                except ValueError as e:
                    self.fail_request(seq.request.request_id, f"structured output: {e}")
                    continue
            idx = where[i]
            lps, tops = outcome.logprobs[idx], outcome.top[idx]
            for j, token in enumerate(tokens):
                seq.append(
                    token,
                    self.eos_token_id,
                    self.max_model_len,
                    None if lps is None else lps[j],
                    None if tops is None else tops[j],
                )
                self.stats.generated_tokens += 1
                if seq.finished:
                    break
            if seq.finished:
                if seq_id not in finished:  # ended here by a stop string: the scheduler may not know yet
                    scheduling.abort(self.scheduler, seq_id)
            elif seq_id in finished:
                seq.finish(_REASONS.get(finished[seq_id], finished[seq_id]))
        self.stats.steps += 1
        self.stats.forward_s += result.forward_s
        self.stats.sample_s += result.sample_s

    def _propose_drafts(self, ids, inputs, accepted_after: dict[int, int], finished) -> None:
        """The drafter proposes after every sequence that emitted and goes on; the varlen rule (or
        all of them) decides how many the scheduler feeds next step."""
        requests = []
        for i, seq_id in enumerate(ids):
            seq = self.seqs.get(seq_id)
            if i not in accepted_after or seq is None or seq.finished or seq_id in finished:
                continue
            p = seq.request.params
            room = min(
                p.max_tokens - seq.num_generated,
                self.max_model_len - len(seq.token_ids),
            )
            k = min(self._spec.nextn, room - 1)  # the step emits one token beyond its drafts
            if k < 1:
                continue
            base = inputs[i].base_position
            requests.append(
                DraftRequest(
                    seq_id=seq_id,
                    context=seq.token_ids[:-1],
                    next_token=seq.token_ids[-1],
                    num_drafts=k,
                    params=self._row_params(seq, len(seq.token_ids)),
                    base_position=base,
                    num_accepted=accepted_after[i],
                )
            )
        t0 = time.perf_counter()
        for seq_id, drafts in self._spec.propose(requests).items():
            if drafts:
                scheduling.set_draft_tokens(self.scheduler, seq_id, drafts)
        self.stats.draft_s += time.perf_counter() - t0


_REASONS = {"stop": "stop", "length": "length", "max_model_len": "length", "abort": "abort"}


def _init_worker_thread(num_threads: int, device: torch.device) -> None:
    torch.set_num_threads(num_threads)
    if device.type == "cuda" and device.index is not None:  # "cuda" alone: the current device
        torch.cuda.set_device(device)


def _int_or_none(v) -> int | None:
    if isinstance(v, list | tuple):
        v = v[0] if v else None
    return None if v is None else int(v)


__all__ = ["EngineStats", "LLMEngine", "np"]
