"""CUDA graphs for the paged runtime's decode step, one per token-count bucket (spec engine.md §3.5).

Decode is host-bound (thousands of small kernels per step), so each decode step of up to the largest
bucket's token count replays a graph captured over the graph-safe forward
(`models.deepseek_v41.paged.v41_static_decode_forward`: no host sync, shapes fixed by the bucket).
Prefill, mixed and verification steps, steps above the largest bucket or past `max_context`, and
everything under `DEEPINFER_ENFORCE_EAGER=1` (read by the engine) run eagerly.

Buckets are token counts (`build_graph_batch_sizes`). A step of n tokens replays the smallest bucket
b >= n: rows n .. b-1 are placeholder sequences (token 0 at position 0, a block table holding only the
reserved dummy block, which the scheduler never hands out), so they write the dummy block only, read
only what they wrote, and no row's result depends on another row's values. The real rows' logits are
rows 0 .. n-1 of the graph's output.

All graphs share one memory pool; they are captured largest first (the pool then fits every smaller
one), each after a warm-up run on the capture stream (fills weight-conversion and kernel caches, which
allocate, before capture). `destroy()` frees them (before process groups go away).

`DecodeGraphSettings(capture=False)` runs the same static step without graphs: on the CPU it is how
the padding, buckets and dummy-block writes are tested (graphs are never captured on the CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from .. import batch_invariant, numerics
from .metadata import StaticDecodeMetadata, StepMetadata

log = logging.getLogger("deepinfer_model.runtime")

DEFAULT_INTERVAL = 8
PLACEHOLDER_TOKEN = 0


def build_graph_batch_sizes(max_size: int, interval: int = DEFAULT_INTERVAL) -> list[int]:
    """Buckets (token counts), ascending: powers of two below `interval`, then multiples of `interval`
    below `max_size`, then `max_size` (every value at most `max_size`)."""
    if int(max_size) != max_size or max_size < 1:
        raise ValueError(
            f"max_size (the largest decode bucket, tokens) must be an integer >= 1, got {max_size}"
        )
    if int(interval) != interval or interval < 1:
        raise ValueError(f"interval (CUDA-graph bucket step) must be an integer >= 1, got {interval}")
    sizes = []
    p = 1
    while p < interval and p < max_size:
        sizes.append(p)
        p *= 2
    m = interval
    while m < max_size:
        sizes.append(m)
        m += interval
    sizes.append(max_size)
    return sorted(set(sizes))


@dataclass(frozen=True)
class DecodeGraphSettings:
    """`max_batch_size`: tokens of the largest bucket (max_num_seqs x (1 + drafts) in the reference; only
    one-token-per-sequence decode steps are graphed here). `max_context`: the longest context (tokens
    after the step) a graphed step may have; the static step reads every compressed entry up to it, so
    its cost follows `max_context`, not the step's contexts. `interval`: bucket step. `capture`: False
    runs the static step eagerly (CPU tests)."""

    max_batch_size: int
    max_context: int
    interval: int = DEFAULT_INTERVAL
    capture: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {self.max_context}")
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")


def decode_graph_settings(
    device: torch.device | str,
    max_num_seqs: int,
    max_model_len: int,
    enforce_eager: bool = False,
    interval: int = DEFAULT_INTERVAL,
) -> DecodeGraphSettings | None:
    """The engine's settings: graphs on CUDA devices unless `enforce_eager`; None (eager) elsewhere."""
    if enforce_eager or torch.device(device).type != "cuda":
        return None
    return DecodeGraphSettings(max_num_seqs, max_model_len, interval)


class DecodeGraphRunner:
    """Static input buffers, one graph (or, with `capture=False`, one static metadata) per bucket.

    `runner` is the `PagedRunner` whose model and cache it drives; its cache holds one block more than
    the scheduler's `num_blocks`: block `num_blocks`, the dummy block of placeholder rows.
    """

    def __init__(self, runner, settings: DecodeGraphSettings) -> None:
        from ..models.deepseek_v41.paged import static_decode_problem, v41_static_decode_forward

        problem = static_decode_problem(runner.model)
        if problem:
            raise ValueError(problem)
        self.runner = runner
        self.settings = settings
        self.device = runner.device
        if settings.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        self.forward = v41_static_decode_forward
        self.buckets = build_graph_batch_sizes(settings.max_batch_size, settings.interval)
        self.block_size = runner.block_size
        self.dummy_block = runner.num_blocks
        self.max_blocks = -(-settings.max_context // self.block_size)
        # one int64 row per token: id, position, write slot, block table
        width = 3 + self.max_blocks
        self.inputs = torch.zeros(self.buckets[-1], width, dtype=torch.long, device=self.device)
        pin = self.device.type == "cuda"
        self.staging = torch.zeros(self.buckets[-1], width, dtype=torch.long, device="cpu", pin_memory=pin)
        self._staged = None  # event of the last copy out of `staging` (CUDA)
        self.metas = {b: self._meta(b) for b in self.buckets}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.mode = None  # (numerics mode) the graphs were captured under
        self.replays = 0  # steps run through a bucket (graph replays, or static steps without capture)

    def _meta(self, b: int) -> StaticDecodeMetadata:
        v = self.inputs[:b]
        return StaticDecodeMetadata(self.block_size, v[:, 0], v[:, 1], v[:, 2], v[:, 3:], self.dummy_block)

    # ---------------------------------------------------------------------------------------------
    def problem(self, meta: StepMetadata) -> str | None:
        """Why the step `meta` must run eagerly (None: it replays a bucket)."""
        n = len(meta.query_lens)
        if n == 0 or np.any(meta.query_lens != 1):
            return "not a decode step (one query token per sequence)"
        if meta.host_logits_rows is None or not np.array_equal(meta.host_logits_rows, np.arange(n)):
            return "a decode step needs logits for every sequence's token"
        if n > self.buckets[-1]:
            return f"{n} tokens > the largest bucket {self.buckets[-1]}"
        if int(meta.ends.max()) > self.settings.max_context:
            return f"context {int(meta.ends.max())} > max_context {self.settings.max_context}"
        if batch_invariant.enabled():
            return "batch-invariant mode has its own attention layout (not graph-safe)"
        if self.mode is not None and numerics.mode() != self.mode:
            return f"graphs were captured with DEEPINFER_NUMERICS={self.mode}"
        return None

    def select(self, n: int) -> int:
        """The smallest bucket >= n tokens."""
        i = int(np.searchsorted(self.buckets, n))
        if i == len(self.buckets):
            raise ValueError(f"{n} tokens exceed the largest CUDA-graph bucket {self.buckets[-1]}")
        return self.buckets[i]

    def _fill(self, b: int, meta: StepMetadata | None, input_ids) -> None:
        """Rows 0 .. n-1 from the step, n .. b-1 placeholders, into the bucket's rows of `inputs`."""
        host = self.staging if self.device.type == "cuda" else self.inputs
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copy has read `staging`
        buf = host[:b].numpy()
        buf[:, 0] = PLACEHOLDER_TOKEN
        buf[:, 1] = 0
        buf[:, 2] = self.dummy_block * self.block_size
        buf[:, 3:] = self.dummy_block
        if meta is not None:
            n = len(meta.query_lens)
            buf[:n, 0] = np.asarray(input_ids, dtype=np.int64)
            buf[:n, 1] = meta.host_positions
            buf[:n, 2] = meta.host_write_slots
            cols = min(meta.tables.shape[1], self.max_blocks)
            t = meta.tables[:, :cols]
            buf[:n, 3 : 3 + cols] = np.where(t >= 0, t, self.dummy_block)
        if host is not self.inputs:
            self.inputs[:b].copy_(host[:b], non_blocking=True)
            self._staged = torch.cuda.Event()
            self._staged.record()

    def run(self, meta: StepMetadata, input_ids) -> torch.Tensor:
        """FP32 logits [n, vocab] of an eligible decode step (`problem(meta)` is None)."""
        n = len(meta.query_lens)
        b = self.select(n)
        self._fill(b, meta, input_ids)
        self.replays += 1
        if b in self.graphs:
            graph, out = self.graphs[b]
            graph.replay()
            return out[:n].clone()  # the next replay overwrites `out`
        return self.forward(self.runner.model, self.metas[b], self.runner.cache)[:n]

    # ---------------------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, in one shared pool (CUDA only)."""
        if not self.settings.capture:
            return
        import time

        t0 = time.perf_counter()
        self.mode = numerics.mode()
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        model, cache = self.runner.model, self.runner.cache
        for b in reversed(self.buckets):
            self._fill(b, None, None)
            meta = self.metas[b]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: caches that allocate fill before capture
                self.forward(model, meta, cache)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self.forward(model, meta, cache)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode CUDA graphs (buckets %s, max_context %d) in %.1f s",
            len(self.graphs),
            self.buckets,
            self.settings.max_context,
            time.perf_counter() - t0,
        )

    def destroy(self) -> None:
        """Free the graphs and their pool (required before destroying process groups)."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None
