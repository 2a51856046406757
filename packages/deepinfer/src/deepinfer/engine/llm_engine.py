"""`LLMEngine`: requests in, `RequestOutput`s out; owns the scheduler, the model worker and the loop.

One step (ARCHITECTURE.md): schedule -> runner forward -> sample -> scheduler.update_from_output ->
detokenize / stop strings -> outputs. The engine holds its parts and one step strategy:

- `request_table.py`: admission and request state; `step_builder.py`: scheduler output -> `StepInput`;
  `output_processor.py`: commit to the scheduler, emit into the requests; `stats.py`: counters.
- the strategy: `step_strategy.SyncStep` (each step finished before `step()` returns),
  `async_step.AsyncStep` (the model one step ahead on a worker thread), `spec_step.SpecStep`
  (DSpark drafts verified each step) or `spec_async_step.SpecAsyncStep` (a drafting engine's plain
  steps one step ahead, its drafted ones in `SpecStep`). The sampler's draw depends only on (seed,
  position), and a runner's logits only on the sequence (the paged runner is bitwise equal to the
  stateless forward), so every loop emits the same tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from deepinfer_model import cache_specs, decode_graph_settings, load_model, make_runner
from deepinfer_spec import StepTimeCurve

from .. import envs
from ..default_model import resolve_model
from ..engine_args import EngineArgs
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams, validate_vocab_fields
from ..tokenizer import load_tokenizer, load_tokenizer_config
from . import scheduling
from .async_step import AsyncStep
from .device_timing import device_timeline
from .drafting import Drafter
from .handoff import HandoffRecord
from .images import ImageInputs, ImagePrompt
from .kv_sizing import kv_cache_blocks
from .kv_tier import KVTier, TierSettings
from .output_processor import OutputProcessor
from .pd_roles import CompletionRole, PromptRole, needs_role
from .prompts import PromptChecks
from .request import RequestState, SeqState
from .request_table import RequestTable
from .spec_async_step import SpecAsyncStep, runs_plain_steps_ahead
from .spec_decode import SpecDecoder
from .spec_step import SpecStep, make_spec_decoder, resolve_nextn
from .stats import EngineStats, collect_device_timing, log_stats
from .step_builder import StepBuilder
from .step_strategy import StepContext, StepStrategy, SyncStep
from .tier_fingerprint import tier_fingerprint
from .tier_transfers import TierTransfers
from .truncation import Truncation, settings_from_env
from .worker import ModelWorker

if TYPE_CHECKING:
    from .dp_rank import DataParallelRank

logger = logging.getLogger("deepinfer")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class LLMEngine(PromptChecks):
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
        for the draft policy (DEEPINFER_ENABLE_MTP_VARLEN, default on), a StepTimeCurve or its JSON file (default: measured now);
        dp: this engine is one rank of a data-parallel world (data_parallel.py): its model's experts
        are sharded over the EP group and every step starts with the ranks' vote."""
        envs.warn_unknown()
        if dp is None and args.world_size > 1:  # one process would run what the layout spreads over ranks
            raise ValueError(
                f"an LLMEngine is one process; the layout {args.layout.describe()} runs through LLM / AsyncLLM "
                "(which spawn the ranks) or on launched ranks"
            )
        self.args = args
        self.dp = dp
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.model_path, self.is_default_model = resolve_model(args.model)
        tok_path = Path(args.tokenizer) if args.tokenizer else self.model_path
        self.tokenizer = load_tokenizer(tok_path)
        self.tokenizer_config = load_tokenizer_config(tok_path)
        self.device = args.torch_device
        self.model = self._load_model()
        self._read_model_limits()
        self.engine_type = args.engine_type
        if self.engine_type != "normal":  # pd_roles.py: synchronous, no drafts
            if num_speculative_tokens or drafter is not None:
                raise ValueError(
                    f"num_speculative_tokens must be 0 on a {self.engine_type} engine (prefill / decode "
                    f"disaggregation does not draft), got {num_speculative_tokens}"
                )
            num_speculative_tokens = 0
        nextn = resolve_nextn(num_speculative_tokens, drafter, self.model, self.is_default_model)
        if dp is not None:  # a forward carries at most the token budget, or every sequence's verify rows
            dp.attach_deepep(
                max(self.max_num_batched_tokens, args.max_num_seqs * (1 + nextn)), envs.DEEPINFER_EP_BACKEND
            )
        # YoCo truncation: checked here (V4.1 split, KEEP >= W + B) before anything is allocated.
        self.truncation = Truncation(settings_from_env(), self.model, nextn)
        num_blocks = kv_cache_blocks(
            device=self.device,
            block_size=args.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=args.max_num_seqs,
            num_kv_blocks=args.num_kv_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
            bytes_per_block=self._kv_bytes_per_block(),
        )
        self.use_async = args.use_async and self.engine_type == "normal"
        # plain steps of a drafting engine in the asynchronous loop: only plain steps are scheduled ahead
        self._plain_steps_ahead = runs_plain_steps_ahead(nextn, self.use_async, dp is not None)
        tier_settings = TierSettings(args.kv_host_tier_bytes, args.kv_disk_tier_bytes, args.kv_disk_tier_dir)
        if tier_settings.enabled and args.runner != "paged":
            raise ValueError(
                f"a KV tier (kv_host_tier_bytes / kv_disk_tier_bytes) needs runner='paged', got {args.runner!r}"
            )
        self.scheduler = scheduling.make_scheduler(
            block_size=args.block_size,
            num_blocks=num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            chunked_prefill=args.chunked_prefill,
            # drafts assumed for a step scheduled ahead of one in flight (and the most set per step): none
            # where only plain steps run ahead (SpecDecoder feeds at most nextn)
            num_speculative_tokens=0 if self._plain_steps_ahead else nextn,
            enable_prefix_caching=args.enable_prefix_caching,
            finish_preempted=args.stop_preempted_request,
            report_evictions=tier_settings.enabled,
            engine_type=self.engine_type,
        )
        self.runner = self._make_runner(num_blocks, nextn)
        self.kv_tier = self._make_kv_tier(tier_settings)
        self.worker = ModelWorker(
            self.runner,
            timeline=device_timeline(self.device),
            collectives=dp.collectives if dp is not None else None,
        )
        self.stats = EngineStats()
        self.table = RequestTable(
            self.scheduler,
            self.tokenizer,
            tok_path,
            self.truncation,
            seed=args.seed,
            vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id,
            max_model_len=self.max_model_len,
        )
        blacklist = tuple(envs.parse_token_ranges(envs.DEEPINFER_DECODE_TOKEN_BLACKLIST))
        self.builder = StepBuilder(self.table, self.truncation, self.eos_token_id, blacklist)
        self.output = OutputProcessor(self.table, self.stats, self.max_model_len)
        self.role = needs_role(self.engine_type, self)
        if isinstance(self.role, PromptRole):  # its prefills sample nothing; their blocks leave right after
            self.output.prompt_only = True
            self.output.on_finished = self.role.on_finished
        self.spec: SpecDecoder | None = None
        if nextn:
            self.spec = make_spec_decoder(
                nextn, drafter, step_time_curve, self.model, self.runner, args.max_num_seqs
            )
        self.strategy = self._choose_strategy()
        # requests with images (worker processes start on the first)
        self.images = ImageInputs(self.model, args.encoder_cache_tokens)

    def _choose_strategy(self) -> StepStrategy:
        """Drafting: plain steps in the asynchronous loop and drafted ones synchronously where the draft
        policy decides who drafts and async_scheduling is on (one process), else every step synchronous;
        not drafting: the asynchronous or the synchronous loop."""
        ctx = StepContext(
            self.scheduler,
            self.worker,
            self.table,
            self.builder,
            self.output,
            self.stats,
            self.dp,
            self.kv_tier,
        )
        if self._plain_steps_ahead:
            return SpecAsyncStep(ctx, self.spec, self.device)
        if self.spec is not None:
            return SpecStep(ctx, self.spec)
        return AsyncStep(ctx, self.device) if self.use_async else SyncStep(ctx)

    def _load_model(self):
        dtype = _DTYPES[self.args.dtype]
        if self.dp is not None:  # only this rank's experts
            return self.dp.load_model(self.model_path, dtype, self.device)
        if (
            self.device.type == "cpu"
        ):  # the two-argument call: wrappers of load_model(path, dtype) keep working
            return load_model(self.model_path, dtype)
        # weights go to the device in their stored format and are dequantised there
        return load_model(self.model_path, dtype, device=self.device)

    def _read_model_limits(self) -> None:
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        raw_config = json.loads((self.model_path / "config.json").read_text())
        text_config = raw_config.get("text_config", {})
        self.eos_token_id = _int_or_none(raw_config.get("eos_token_id", text_config.get("eos_token_id")))
        self.bos_token_id = _int_or_none(raw_config.get("bos_token_id", text_config.get("bos_token_id")))
        model_limit = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
        self.max_model_len = min(self.args.max_model_len or 4096, model_limit)
        if self.args.max_model_len and self.args.max_model_len > model_limit:
            raise ValueError(f"max_model_len must be <= the model's max_position_embeddings ({model_limit})")
        self.max_num_batched_tokens = self.args.max_num_batched_tokens or max(self.max_model_len, 4096)

    def _kv_bytes_per_block(self) -> int | None:
        """One block of every paged KV pool of this model (None for the recompute runner: no cache)."""
        if self.args.runner != "paged":
            return None
        yoco = self.truncation.settings if self.truncation.enabled else None
        return sum(s.bytes_per_block() for s in cache_specs(self.model, self.args.block_size, yoco))

    def _make_runner(self, num_blocks: int, nextn: int):
        runner = self._new_runner(num_blocks, nextn)
        if self.dp is not None and self.dp.state.cp.size > 1:  # chunks split over the CP ranks
            runner.use_context_parallel(self.dp.state.cp.group)
        return runner

    def _new_runner(self, num_blocks: int, nextn: int):
        args, dp = self.args, self.dp
        return make_runner(
            args.runner,
            self.model,
            num_blocks=num_blocks,
            block_size=args.block_size,
            yoco=self.truncation.settings if self.truncation.enabled else None,
            backtracking=self.truncation.backtracking,
            # decode / verification CUDA graphs (CUDA only): buckets up to max_num_seqs x (1 + nextn)
            # tokens; the drafter itself runs eagerly
            decode_graphs=decode_graph_settings(
                self.device,
                args.max_num_seqs,
                self.max_model_len,
                # expert parallel: the all-to-alls have host-side split sizes, nothing to capture
                enforce_eager=args.enforce_eager
                or envs.DEEPINFER_ENFORCE_EAGER
                or (dp is not None and dp.ep_size > 1),
                interval=envs.DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL,
                capture_all=envs.DEEPINFER_CUDAGRAPH_CAPTURE_ALL,
                capture_on_use=envs.DEEPINFER_CUDAGRAPH_CAPTURE_ON_USE,
                batch_invariant=envs.DEEPINFER_CUDAGRAPH_BATCH_INVARIANT,
                draft=envs.DEEPINFER_CUDAGRAPH_DRAFT,
                compile=envs.DEEPINFER_CUDAGRAPH_COMPILE,
                nextn=nextn,
            ),
        )

    def _make_kv_tier(self, settings: TierSettings) -> TierTransfers | None:
        """The host / disk tier below the device prefix cache (None when off). A data-parallel rank keeps
        its disk files apart from the other ranks'."""
        if not settings.enabled:
            return None
        if settings.disk_bytes > 0 and self.dp is not None:
            settings = TierSettings(
                settings.host_bytes, settings.disk_bytes, str(Path(settings.disk_dir) / f"rank{self.dp.rank}")
            )
        fingerprint = tier_fingerprint(self.model_path, self.args, self.runner, self.truncation, self.device)
        tier = KVTier(settings, fingerprint, pin_memory=self.device.type == "cuda")
        return TierTransfers(tier, self.scheduler, self.runner, self.args.block_size)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ------------------------------------------------------------------ requests
    @property
    def requests(self) -> dict[str, RequestState]:
        return self.table.requests

    @property
    def seqs(self) -> dict[int, SeqState]:
        return self.table.seqs

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        seeds: list[int] | None = None,
        cached_blocks: list[list[int]] | None = None,
        multi_modal_data: dict | None = None,
        handed_off_images: ImagePrompt | None = None,
    ) -> None:
        """Queue one request; raises ValueError (naming the problem) without touching other requests.
        seeds: the n samples' seeds when params.seq_seed is None (a data-parallel front draws them
        from one stream for all ranks); default: from this engine's seed stream. cached_blocks: a
        COMPLETION engine's per-sample blocks already holding the prompt (`add_handoff` passes them).
        multi_modal_data: `{"image": [bytes | PIL image | path, ...]}`, each image taking the next `<image>`
        of the text `prompt`, or the next image placeholder id of `prompt_token_ids` when given
        (`images.py`); the images are encoded here, once per distinct image. It may also be the
        `PreparedImages` that `self.images.prepare(multi_modal_data)` made of it on another thread: then
        only the vision tower runs here, the decoding and preprocessing are done. handed_off_images: a
        COMPLETION engine's facts of a prompt prefilled with images (`ImagePrompt.handed_off`, with
        `cached_blocks`)."""
        self.table.check_new(request_id, params)
        validate_vocab_fields(params, self.vocab_size)
        images = handed_off_images
        if multi_modal_data is not None:
            images = self.images.prompt(
                prompt, prompt_token_ids, multi_modal_data, self.encode, self.tokenizer
            )
            prompt_token_ids = images.ids
        elif prompt_token_ids is None:
            if prompt is None:
                raise ValueError("either prompt or prompt_token_ids must be given")
            prompt_token_ids = self.encode(prompt)
        prompt_token_ids = self.validate_request(
            prompt_token_ids, params, None if images is None else images.sentinel
        )
        if self.engine_type == "completion" and cached_blocks is None:
            raise ValueError("a completion engine takes requests as hand-offs (add_handoff), not prompts")
        run_params = params
        if isinstance(self.role, PromptRole):
            run_params = self.role.admit(request_id, params, seeds)
        idle = self.worker.timeline is not None and not self.requests and not self.strategy.busy()
        try:
            self.table.add(
                request_id, prompt, prompt_token_ids, run_params, arrival_time, seeds,
                cached_blocks=cached_blocks, images=images,
            )  # fmt: skip
        except ValueError:
            if isinstance(self.role, PromptRole):
                self.role.forget(request_id)
            raise
        if idle:  # the device sat idle for want of requests, not the loop: no gap before the next step
            self.worker.timeline.break_chain()
        self.stats.prompt_tokens += len(prompt_token_ids) * run_params.n

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its blocks are freed. Its output (finish_reason "abort") is returned by step()."""
        if isinstance(self.role, PromptRole):
            self.role.forget(request_id)
        return self.table.abort(request_id)

    def withdraw_request(self, request_id: str):
        """Take back a request that has not started (waiting, never scheduled, no grammar) without an
        output, for another engine to serve (a data-parallel move); its `RequestState`, or None when
        it cannot be taken back."""
        state = self.table.withdraw(request_id)
        if state is not None:
            self.stats.prompt_tokens -= len(state.prompt_token_ids) * state.params.n
        return state

    # ------------------------------------------------------------------ prefill / decode hand-offs
    def take_handoffs(self) -> list[HandoffRecord]:
        """PROMPT engine: the hand-off records of the requests prefilled since the last call (their
        outputs from step() finish "prefilled")."""
        if not isinstance(self.role, PromptRole):
            raise ValueError(f"take_handoffs needs engine_type='prompt', this engine is {self.engine_type!r}")
        return self.role.take()

    def add_handoff(self, record: HandoffRecord) -> None:
        """COMPLETION engine: decode a request a PROMPT engine prefilled. Raises HandoffError (another
        engine's cache facts or block size, named), ValueError (the request itself), or DecodeFull when
        its blocks or sequences are not free now (hold it and try again after a step)."""
        if not isinstance(self.role, CompletionRole):
            raise ValueError(
                f"add_handoff needs engine_type='completion', this engine is {self.engine_type!r}"
            )
        self.role.add(record)

    def handoff_capacity(self) -> dict:
        """COMPLETION engine: {"free_blocks", "free_seqs"} not reserved by the requests it holds."""
        if not isinstance(self.role, CompletionRole):
            raise ValueError(
                f"handoff_capacity needs engine_type='completion', this engine is {self.engine_type!r}"
            )
        return self.role.capacity()

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request and settle the step in flight (Ctrl-C path); returns their outputs."""
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self.strategy.settle()
        self.table.release_idle(steps_in_flight=False)
        return self.table.take_done()

    def fail_request(self, request_id: str, message: str) -> None:
        self.table.fail(request_id, message)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.strategy.busy() or bool(self.table.done)

    def step_in_flight(self) -> bool:
        """Whether a step already runs on the model thread (the asynchronous loop, between `step()`
        calls): the next `step()` schedules the one after it."""
        return self.pipeline is not None and self.strategy.busy()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Advance by one model step; returns the requests that finished in it."""
        self.strategy.step()
        if isinstance(self.role, PromptRole):  # exported: a prefilled sequence's blocks are free now
            self.table.release_pending()
        collect_device_timing(self.stats, self.worker.timeline)  # non-blocking: the completed steps
        if not self.args.disable_log_stats:
            log_stats(self.stats, self.scheduler)
        return self.table.take_done()

    def flush_device_timing(self) -> None:
        """Wait for the device timing of every step launched so far and add it to `stats` (the end
        of a measured run; step() only collects what has completed). No-op on the CPU."""
        collect_device_timing(self.stats, self.worker.timeline, wait=True)

    def close(self) -> None:
        self.strategy.close()
        self.builder.close()
        self.table.close()
        self.images.close()
        runner_close = getattr(self.runner, "close", None)  # decode CUDA graphs (before process groups)
        if runner_close is not None:
            runner_close()

    # ------------------------------------------------------------------ introspection
    @property
    def pipeline(self):
        """The asynchronous loop's model thread (`StepPipeline`); None in the other loops."""
        return getattr(self.strategy, "pipeline", None)

    def scheduler_stats(self) -> dict:
        return scheduling.stats(self.scheduler)

    def kv_tier_stats(self) -> dict | None:
        """The KV tier's counters (blocks loaded per tier, stored, demoted to disk, dropped, failed loads,
        seconds storing and loading, bytes and blocks held); None when the tier is off."""
        if self.kv_tier is None:
            return None
        tier = self.kv_tier.tier
        d = tier.stats.as_dict()
        d.update(
            host_bytes_used=tier.host_bytes,
            disk_bytes_used=tier.disk_bytes,
            blocks_held=len(tier.keys()),
            block_size=self.args.block_size,
        )
        return d

    def spec_stats(self) -> dict | None:
        """Speculative-decoding accounting (SpecStats.summary() + nextn, varlen, drafter seconds);
        None when drafting is off. Throughput keys use the decode steps' forward + sample + draft time."""
        return None if self.spec is None else self.spec.summary()

    def spec_counts(self) -> dict | None:
        """The cumulative draft counts (plain lists and numbers, so a rank can send them to its front):
        nextn, per draft position drafts verified / accepted, request-steps and steps drafted, drafter
        host seconds. A window's acceptance is the difference of two. None when drafting is off."""
        if self.spec is None:
            return None
        s = self.spec.stats
        return {
            "nextn": self.spec.nextn,
            "verified": [int(v) for v in s.verified],
            "accepted": [int(a) for a in s.accepted],
            "request_steps": int(s.request_steps),
            "steps": int(s.steps),
            "draft_s": float(self.spec.draft_s),
        }

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.spec is None else self.spec.nextn


def _int_or_none(v) -> int | None:
    if isinstance(v, list | tuple):
        v = v[0] if v else None
    return None if v is None else int(v)


__all__ = ["EngineStats", "LLMEngine"]
