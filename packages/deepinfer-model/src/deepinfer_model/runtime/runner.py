"""`PagedRunner`: the cached model runner, a drop-in for `runner.RecomputeRunner`.

Same construction (`model, num_blocks, block_size`) and the same `execute(batch) -> logits` contract
(a `StepBatch` or a `deepinfer_sched.SchedulerOutput`; for each sequence in batch order its last
`logits_lens[i]` query positions, FP32). Each step costs only the new tokens' compute plus reading
their visible keys, instead of re-running the whole prefix.
"""

from __future__ import annotations

import numpy as np
import torch

from ..family import check_context_parallel, family_of
from ..numerics import pinned
from ..runner.recompute import RecomputeRunner
from ..runner.step import StepBatch
from .block_io import export_blocks, import_blocks
from .cp_rows import PagedMirrorRows
from .device import model_device
from .metadata import StepMetadata
from .pools import TOKEN_IDS, PagedKVCache, PoolSpec, blocks_for_budget, log
from .step_buffers import StepBuffers


def cache_specs(model, block_size: int, yoco=None) -> list[PoolSpec]:
    """The pools `model` needs (its family's), for a given block size; with `yoco` (enabled truncation
    settings) the pools of its per-step extras too."""
    family = family_of(model)
    specs = family.cache_specs(model, block_size)
    if yoco is not None and yoco.enabled:
        specs += family.extras_specs(yoco, block_size)
    return specs


class PagedRunner:
    """`yoco` (`YocoSettings`, default off): YOCO prefill truncation (spec v41-model §8); `execute` then
    needs each sequence's prompt length. `backtracking` = B of the start-up check KEEP >= W + B.

    `decode_graphs` (`cuda_graphs.DecodeGraphSettings`, default None: every step eager): decode steps
    run the graph-safe static forward through per-bucket CUDA graphs (captured here); the cache then
    holds one reserved dummy block (id `num_blocks`) for the bucket padding. YOCO steps stay eager."""

    # `execute` takes `StepBatch.device_input_ids` (ids known only on the device): the asynchronous loop
    # may then launch a step before the previous step's tokens reach the host
    takes_device_input_ids = True

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        yoco=None,
        backtracking: int = 6,
        decode_graphs=None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = int(model.config.vocab_size)
        self.family = family_of(model)
        # validated truncation settings (None: off), checked at start-up: YOCO model, KEEP >= W + B
        self.yoco = self.family.check_extras(model, yoco, backtracking)
        self.cp_group = None  # context parallel: `use_context_parallel`
        specs = cache_specs(model, block_size, self.yoco)
        # pools live where the weights are: the forward reads and writes them with device index tensors
        self.device = model_device(model)
        # graphs: one more block than the scheduler hands out, written only by placeholder rows
        self.cache = PagedKVCache(specs, num_blocks + (decode_graphs is not None), self.device)
        log.info(
            "paged KV cache on %s: %d blocks of %d tokens, %d B per block, %.1f MiB in %d pools",
            self.device,
            num_blocks,
            block_size,
            self.cache.bytes_per_block,
            self.cache.nbytes / 2**20,
            len(self.cache.pools),
        )
        self.metadata_s = 0.0  # cumulative time building step metadata (benchmarks read it)
        self.buffers = StepBuffers(self.device)  # every step's per-token tensors, reused step after step
        self.graphs = None
        self.draft_graphs = None  # draft steps through CUDA graphs (`draft_graphs`)
        if decode_graphs is not None:
            from .cuda_graphs import DecodeGraphRunner

            problem = self.family.static_problem(model)
            if problem:  # e.g. expert-parallel MoE: every step eager (the dummy block stays unused)
                log.warning("decode CUDA graphs off: %s", problem)
            else:
                self.graphs = DecodeGraphRunner(self, decode_graphs)
                self.graphs.capture()
                self._make_draft_graphs(decode_graphs)

    def _make_draft_graphs(self, settings) -> None:
        """Draft graphs next to the decode graphs when the step drafts (max_query_len = 1 + nextn > 1),
        the model's drafter has a graph-safe path and `settings.draft` asks for them (the default); otherwise
        drafts stay eager."""
        if settings.max_query_len < 2 or not settings.draft or not self.family.has_drafter(self.model):
            return
        from .draft_graphs import DraftGraphRunner

        problem = self.family.static_draft_problem(self.model)
        if problem:
            log.warning("draft CUDA graphs off: %s", problem)
        else:
            self.draft_graphs = DraftGraphRunner(self, settings)

    def close(self) -> None:
        """Free the decode CUDA graphs (if any): call before process groups are destroyed."""
        if self.draft_graphs is not None:
            self.draft_graphs.destroy()
        if self.graphs is not None:
            self.graphs.destroy()

    @classmethod
    def from_memory(
        cls,
        model,
        block_size: int,
        kv_cache_memory_bytes: int | None = None,
        memory_fraction: float = 0.1,
        yoco=None,
        backtracking: int = 6,
        decode_graphs=None,
    ) -> PagedRunner:
        """Size the pools from a byte budget, or from a fraction of the available memory of the model's
        device (host memory on the CPU, free device memory on CUDA)."""
        specs = cache_specs(model, block_size, yoco)
        num_blocks = blocks_for_budget(specs, kv_cache_memory_bytes, memory_fraction, model_device(model))
        if decode_graphs is not None:
            num_blocks = max(1, num_blocks - 1)  # the dummy block comes out of the same budget
        return cls(
            model, num_blocks, block_size, yoco=yoco, backtracking=backtracking, decode_graphs=decode_graphs
        )

    def use_context_parallel(self, group) -> None:
        """Split every step with a chunk over the CP `group` (the balanced mirror split, `runtime.cp_rows`);
        every CP rank must then run the same steps (collective per layer). ValueError for a model family
        without it or with YOCO truncation."""
        check_context_parallel(self.family, self.yoco is not None)
        self.cp_group = group

    @staticmethod
    def bytes_per_block(model, block_size: int) -> int:
        return sum(s.bytes_per_block() for s in cache_specs(model, block_size))

    def execute(self, batch) -> torch.Tensor:
        """float32 logits [batch.num_logits_rows, vocab] (see the module docstring).

        With YOCO truncation each sequence's ORIGINAL prompt length is read from the step
        (`batch.prompt_lens`: the scheduler's `prompt_lens`, or given to a hand-built `StepBatch.of`):
        rect_lo = prompt_len - KEEP stays put through decode, rollback and preemption + recompute, so the
        logits equal `model.forward(tokens, yoco_keep_tokens=KEEP, yoco_mode=mode, yoco_prompt_len=prompt_len)`.
        A step that would read consumer SWA keys cached under another rect_lo (see `yoco_resume_problem`)
        raises ValueError before touching the cache.
        """
        import time

        t0 = time.perf_counter()
        if not isinstance(batch, StepBatch):
            batch = StepBatch.from_scheduler_output(batch)
        if len(batch.input_ids) == 0:  # nothing to compute (logits_lens are 0 too)
            return torch.empty(0, self.vocab_size, device=self.device)
        images = batch.step_image_features()
        # validates the ids on the host (the embedding then skips its device-side check); a step with
        # images carries sentinel ids past the vocabulary, which the model's image embedding checks
        meta = StepMetadata.build(
            batch,
            self.block_size,
            self.num_blocks,
            self.device,
            self.vocab_size if images is None else None,
            self.buffers,
        )
        extras = None
        if self.yoco is not None:
            extras = self.family.step_extras(
                self.model, meta, self.cache, self.yoco, batch.seq_ids, batch.prompt_lens
            )
        split = None
        if self.cp_group is not None and int(meta.query_lens.max()) > 1:
            # a step with a chunk (prefill, verify block) is split over the CP ranks; decode-only steps
            # run whole on every CP rank (one row per sequence: nothing worth a collective)
            split = PagedMirrorRows(meta, self.cp_group)
        if (
            split is None
            and images is None
            and self.graphs is not None
            and self.yoco is None
            and self.graphs.problem(meta) is None
        ):
            self.metadata_s += time.perf_counter() - t0
            logits = self.graphs.run(meta, batch.input_ids)  # writes token ids itself
            self._last_meta = meta
            self._last_seq_ids = np.asarray(batch.seq_ids, dtype=np.int64)
            return logits
        if TOKEN_IDS in self.cache.pools:
            self.cache.write(TOKEN_IDS, meta.write_slots, meta.input_ids)
        self.metadata_s += time.perf_counter() - t0
        # (a family's forward takes `row_split` / `images` only where its models can: passed when set)
        optional = {"row_split": split, "images": images}
        kwargs = {k: v for k, v in optional.items() if v is not None}
        logits = self.family.forward(self.model, meta, self.cache, extras, **kwargs)
        self._last_meta = meta
        self._last_seq_ids = np.asarray(batch.seq_ids, dtype=np.int64)
        return logits

    def export_blocks(self, block_ids, meta: dict | None = None):
        """Every pool's rows of `block_ids` on the host (`block_io.BlockPayload`)."""
        return export_blocks(self.cache, block_ids, self.block_size, meta)

    def import_blocks(self, block_ids, payload) -> None:
        """Write an exported payload's blocks into `block_ids` (one id per block, same pool layout)."""
        import_blocks(self.cache, block_ids, payload, self.block_size)

    def last_step_index(self, seq_id: int) -> int | None:
        """The batch index of `seq_id` in the last executed step (None if it was not in it)."""
        ids = getattr(self, "_last_seq_ids", None)
        if ids is None:
            return None
        hits = np.flatnonzero(ids == seq_id)
        return int(hits[0]) if len(hits) else None

    def yoco_resume_problem(self, block_table, start: int, query_len: int, prompt_len: int) -> str | None:
        """Would a step of one sequence (its block table, first position `start`, `query_len` tokens, its
        prompt length) read consumer SWA keys cached under another rect_lo? The reason, or None (safe).
        An engine calls it on a prefix-cache hit and recomputes from 0 instead when it is not None."""
        if self.yoco is None:
            return None
        batch = StepBatch.of(
            [0], [start], [query_len], [np.asarray(block_table, dtype=np.int64)], np.zeros(query_len), [0]
        )
        meta = StepMetadata.build(batch, self.block_size, self.num_blocks)
        return self.family.resume_problem(self.model, self.cache, meta, self.yoco, prompt_len)

    @pinned  # the numerics settings read once per draft forward, as the target's forward reads them per step
    def draft(
        self,
        next_tokens,
        num_draft_tokens: int,
        seq_indices=None,
        sampler=None,
        last_positions=None,
        tokens_only: bool = False,
    ) -> list:
        """V4.1 drafter outputs after the last `execute`: for each sequence of that step (or the batch
        indices `seq_indices`), one `DraftOutput` of `num_draft_tokens` tokens drafted after
        `next_tokens[k]`, the token the target produced at its last position — or at
        `last_positions[k]` (absolute), the last ACCEPTED position of a verification step, so that
        rejected draft rows are never read. Equal to
        `model.forward(tokens[: last + 1], num_draft_tokens=n, next_token=g).draft`. Every sequence
        drafts in one batched forward; `sampler`: one per sequence (a list), or one shared callable
        that keeps no state across sequences (it is called for draft s of every sequence before
        draft s + 1); default greedy.

        `tokens_only`: the caller reads `tokens`, `confidence` and `positions` only (the engine). A
        greedy draft (`sampler` None, `greedy`, or a list of `greedy`) of the decode graphs' draft count
        then replays a draft CUDA graph (`draft_graphs`: bitwise the eager draft) where the runner has
        them; its outputs have `logits` and `hidden` None. So does a sampled draft whose row sampler
        describes itself graph-safely (`sampler.static_sampling()` a `DraftSampling`, not None): the
        graph draws as the sampler would (bitwise on the CPU), and each sampled row's output carries
        its q in `probs` (the sampler itself draws nothing). Everything else runs eagerly."""
        family = self.family
        greedy = family.greedy
        if greedy is None:
            raise ValueError(f"drafting needs a model with draft blocks, not {family.model_type!r}")
        meta = getattr(self, "_last_meta", None)
        if meta is None:
            raise ValueError("draft() needs a step executed first")
        seqs = list(range(meta.num_seqs)) if seq_indices is None else [int(i) for i in seq_indices]
        tokens = _host_ints(next_tokens)  # a device tensor costs one copy here, not one per token
        if len(tokens) != len(seqs):
            raise ValueError(
                f"next_tokens must hold one token per drafted sequence ({len(seqs)}), got {len(tokens)}"
            )
        if last_positions is not None:
            last_positions = _host_ints(last_positions)
            if len(last_positions) != len(seqs):
                raise ValueError(
                    f"last_positions must hold one position per drafted sequence ({len(seqs)}), "
                    f"got {len(last_positions)}"
                )
        all_greedy = sampler is None or sampler is greedy
        if not all_greedy and isinstance(sampler, (list, tuple)):
            all_greedy = len(sampler) > 0 and all(s is greedy for s in sampler)
        g = self.draft_graphs
        if tokens_only and g is not None and g.problem(len(seqs), num_draft_tokens) is None:
            sampling = None
            if not all_greedy:
                describe = getattr(sampler, "static_sampling", None)
                sampling = describe() if describe is not None else None
            if all_greedy or sampling is not None:
                seq_arr = np.asarray(seqs, dtype=np.int64)
                last = family.draft_last_positions(self.model, meta, seq_arr, tokens, last_positions)
                return g.run(meta, seq_arr, tokens, last, sampling)
        return family.draft(
            self.model, meta, self.cache, seqs, tokens, num_draft_tokens, sampler or greedy, last_positions
        )


def _host_ints(values) -> list[int]:
    """A list / numpy array / tensor (any device) of integers as Python ints, in one transfer."""
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    return [int(v) for v in np.asarray(values).reshape(-1)]


RUNNERS = {"paged": PagedRunner, "recompute": RecomputeRunner}


def make_runner(
    kind: str, model, num_blocks: int, block_size: int, yoco=None, backtracking: int = 6, decode_graphs=None
):
    """The engine's one switch: `kind` = "paged" (cached, this package) or "recompute" (reference).
    `yoco` (`YocoSettings`) turns on YOCO prefill truncation, which only the paged runner implements;
    `decode_graphs` (`cuda_graphs.DecodeGraphSettings`) decode CUDA graphs, paged runner only (the
    recompute runner ignores it: it is a debugging baseline that always runs eagerly)."""
    if kind not in RUNNERS:
        raise ValueError(f"runner must be one of {sorted(RUNNERS)}, got {kind!r}")
    if kind == "paged":
        return PagedRunner(
            model, num_blocks, block_size, yoco=yoco, backtracking=backtracking, decode_graphs=decode_graphs
        )
    if yoco is not None and yoco.enabled:
        raise ValueError(
            f"YOCO truncation (mode {yoco.mode.value}) needs runner = 'paged'; the recompute runner has none"
        )
    return RUNNERS[kind](model, num_blocks=num_blocks, block_size=block_size)
