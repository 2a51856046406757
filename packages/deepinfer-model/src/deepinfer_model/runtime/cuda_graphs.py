"""CUDA graphs for the paged runtime's decode and verification steps, one per (token-count bucket,
context tier) (spec engine.md §3.5).

Decode is host-bound (thousands of small kernels per step), so each decode or draft-verification step
of up to the largest bucket's token count replays a graph captured over the graph-safe forward
(the model family's `static_forward`: no host sync, shapes fixed by the bucket).

The graph-safe step treats every packed query token as its own row: the token's id, position, write slot
and its sequence's block table. A row reads its window keys and compressed entries from the pools after
every row of the step has written its own, which is exactly what the eager step lets a query see (a
query at p sees keys <= p). So one graph serves plain decode (one token per sequence) and verification
(1 + k tokens per sequence: the last accepted token and k drafts, k varying per sequence) alike; a step
qualifies when every sequence feeds at most `max_query_len` tokens (1 + nextn). Prefill chunks longer
than that, steps above the largest bucket or past `max_context`, and everything under
`DEEPINFER_ENFORCE_EAGER=1` (read by the engine) run eagerly.

Batch-invariant mode (`DEEPINFER_BATCH_INVARIANT=1`) replays graphs too: the static step then lays out
its window keys and selected compressed entries in the eager step's aligned key tiles and computes every
tile product instead of the host-planned subset, so a row's logits are bitwise the eager BI step's
whether its step was replayed or not (the batch-invariant tests of test_cuda_graphs.py; the replay on an
H200: test_cuda_graphs_gpu.py). `DecodeGraphSettings.batch_invariant=False` runs such steps eagerly.
Graphs are captured under one (numerics mode, batch-invariant mode); a step under another runs eagerly.

Buckets are token counts (`build_graph_batch_sizes`, max = max_num_seqs x (1 + nextn)); context tiers
are context lengths (`build_context_tiers`: min_context_tier, doubling, then max_context). A step of n
tokens whose longest context (tokens after the step) is c replays the graph of the smallest bucket
b >= n and the smallest tier t >= c. The tier sizes the step's block tables (ceil(t / block_size)
columns) and so every per-row index range of the static step (index-key scoring, entry validity):
its cost follows the real context, not max_context (max_model_len). In bucket b, rows n .. b-1 are
placeholder sequences of one token each (token 0 at position 0, a block table holding only the
reserved dummy block, which the scheduler never hands out), so they write the dummy block only, read
only what they wrote, and no row's result depends on another row's values. The graph's output holds the logits of every row; the step returns the rows
its `logits_rows` name (for verification: all 1 + k rows of every sequence), gathered after the replay.

All graphs share one memory pool (a graph's intermediates are free again after its capture, for the
next capture to reuse) and write their logits into one static output buffer [largest bucket, vocab]
allocated outside the pool at the first capture (a graph's own output would stay allocated as long as
the graph), so more tiers cost capture time and graph objects, not activation or logits memory. The static inputs are one flat buffer: the
(b, t) graph reads its first b x (3 + blocks(t)) values as a [b, 3 + blocks(t)] matrix (one contiguous
host-to-device copy of just that part per step). A graph is captured on its `capture_on_use`-th use
(`CaptureCounter`; the static step runs uncaptured before), or all of them at start with `capture_all`
(largest first), each after a warm-up run on the capture stream (fills
weight-conversion and kernel caches, which allocate, before capture). `destroy()` frees them (before
process groups go away).

`DecodeGraphSettings(capture=False)` runs the same static step without graphs: on the CPU it is how
the padding, buckets and dummy-block writes are tested (graphs are never captured on the CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from .. import batch_invariant, numerics
from .metadata import StepMetadata
from .static_metadata import StaticDecodeMetadata

log = logging.getLogger("deepinfer_model.runtime")

DEFAULT_INTERVAL = 8
DEFAULT_MIN_CONTEXT_TIER = 256
DEFAULT_CAPTURE_ON_USE = 2  # a bucket's second use captures it (DecodeGraphSettings.capture_on_use)
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


def build_context_tiers(
    max_context: int, smallest: int = DEFAULT_MIN_CONTEXT_TIER, factor: int = 2
) -> list[int]:
    """Context tiers (tokens), ascending: smallest, smallest x factor, ... below `max_context`, then
    `max_context` (one tier when smallest >= max_context). A step runs the smallest tier >= its longest
    context, so its index work is at most `factor` times what its context needs (once above `smallest`)."""
    for name, v, lo in (("max_context", max_context, 1), ("smallest", smallest, 1), ("factor", factor, 2)):
        if int(v) != v or v < lo:
            raise ValueError(f"{name} (context tiers) must be an integer >= {lo}, got {v}")
    tiers = []
    t = int(smallest)
    while t < max_context:
        tiers.append(t)
        t *= int(factor)
    tiers.append(int(max_context))
    return tiers


@dataclass(frozen=True)
class DecodeGraphSettings:
    """`max_batch_size`: tokens of the largest bucket (max_num_seqs x (1 + nextn)). `max_context`: the
    longest context (tokens after the step) a graphed step may have. `min_context_tier`: the smallest
    context tier (`build_context_tiers`: doubling up to max_context; >= max_context gives one tier);
    a step's tier sizes the block tables and the index scores of its static step (the attention itself
    gathers only the top-k selected entries and the window). `interval`: bucket step. `capture`: False runs the static step eagerly (CPU tests).
    `max_query_len`: the most query tokens one sequence may feed in a graphed step (1 + nextn: a
    verification step feeds the last accepted token and its drafts). `capture_all`: capture every bucket
    at start (the reference's warm-up); False (default) captures a bucket when a step needs it for the
    `capture_on_use`-th time, running the same static step uncaptured before (the same kernels on the
    same inputs: the same results): with drafting the bucket list reaches max_num_seqs x (1 + nextn)
    tokens (195 buckets at 256 x 6), most of which a given workload never uses, and a verification or
    draft bucket is often needed once (a probe at the batch size of the moment), where a capture costs
    several steps' time (50-80 ms for the built-in model on an H100, against a few ms for the step).
    `batch_invariant`: replay graphs in batch-invariant mode too (the static step is bitwise the eager
    batch-invariant step on the CPU, and its replay the static step on an H200: `test_cuda_graphs_gpu.py`);
    False runs such steps eagerly. `draft`: DSpark drafts
    (greedy, and sampled ones without logits processors) through CUDA graphs as well
    (`draft_graphs.DraftGraphRunner`; bitwise the eager draft on the CPU, the greedy replay checked on
    an H200: `test_draft_graphs_gpu.py`); False keeps them eager. `compile`: a
    `torch.compile` backend ("inductor" on CUDA; `runtime.compiled`) for the static step of the default
    mode before it is captured (fuses the elementwise ops between the GEMMs); None runs it as written."""

    max_batch_size: int
    max_context: int
    interval: int = DEFAULT_INTERVAL
    capture: bool = True
    max_query_len: int = 1
    capture_all: bool = False
    capture_on_use: int = DEFAULT_CAPTURE_ON_USE
    min_context_tier: int = DEFAULT_MIN_CONTEXT_TIER
    batch_invariant: bool = True
    draft: bool = True
    compile: str | None = None

    def __post_init__(self) -> None:
        from .compiled import BACKENDS

        if self.compile is not None and self.compile not in BACKENDS:
            raise ValueError(f"compile must be None or one of {BACKENDS}, got {self.compile!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {self.max_context}")
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if not 1 <= self.max_query_len <= self.max_batch_size:
            raise ValueError(
                f"max_query_len must lie in [1, max_batch_size={self.max_batch_size}], got {self.max_query_len}"
            )
        if (
            isinstance(self.capture_on_use, bool)
            or not isinstance(self.capture_on_use, int)
            or self.capture_on_use < 1
        ):
            raise ValueError(f"capture_on_use must be an integer >= 1, got {self.capture_on_use!r}")
        if self.min_context_tier < 1:
            raise ValueError(f"min_context_tier must be >= 1, got {self.min_context_tier}")


def decode_graph_settings(
    device: torch.device | str,
    max_num_seqs: int,
    max_model_len: int,
    enforce_eager: bool = False,
    interval: int = DEFAULT_INTERVAL,
    nextn: int = 0,
    capture_all: bool = False,
    batch_invariant: bool = True,
    draft: bool = True,
    compile: str | None = None,
    capture_on_use: int = DEFAULT_CAPTURE_ON_USE,
) -> DecodeGraphSettings | None:
    """The engine's settings: graphs on CUDA devices unless `enforce_eager`; None (eager) elsewhere.
    With `nextn` drafts per step, buckets go up to max_num_seqs x (1 + nextn) tokens and a sequence may
    feed up to 1 + nextn of them (verification steps)."""
    if int(nextn) != nextn or nextn < 0:
        raise ValueError(f"nextn (drafts per step) must be an integer >= 0, got {nextn}")
    if enforce_eager or torch.device(device).type != "cuda":
        return None
    q = 1 + int(nextn)
    return DecodeGraphSettings(
        max_num_seqs * q,
        max_model_len,
        interval,
        max_query_len=q,
        capture_all=capture_all,
        capture_on_use=capture_on_use,
        batch_invariant=batch_invariant,
        draft=draft,
        compile=compile,
    )


def graph_mode() -> tuple[str, bool]:
    """What a captured graph has baked in: the numerics mode and batch-invariant mode (each picks other
    kernels and layouts at capture); a graph replays only under the mode it was captured in."""
    return numerics.mode(), batch_invariant.enabled()


def smallest_at_least(sizes: list[int], n: int, what: str) -> int:
    """The smallest of the ascending `sizes` >= n; ValueError naming `what` if none is."""
    i = int(np.searchsorted(sizes, n))
    if i == len(sizes):
        raise ValueError(f"{n} {what} exceed the largest CUDA-graph bucket {sizes[-1]}")
    return sizes[i]


class CaptureCounter:
    """When a graph runner captures a key's graph: on its `settings.capture_on_use`-th use (CUDA, capture
    on)."""

    def __init__(self, settings: DecodeGraphSettings) -> None:
        self.settings = settings
        self.uses: dict = {}

    def due(self, key, graphs: dict) -> bool:
        """Count one use of `key`; True when its graph should be captured now."""
        uses = self.uses[key] = self.uses.get(key, 0) + 1
        return self.settings.capture and key not in graphs and uses >= self.settings.capture_on_use


class StagedInputs:
    """A graph runner's flat int64 inputs on the device and, on CUDA, a pinned host copy: a step is
    written into `writable()` and sent with one asynchronous copy (`send`); the host copy is rewritten
    only after the previous copy has read it. On the CPU the host copy is the inputs themselves."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.inputs = torch.zeros(size, dtype=torch.long, device=device)
        cuda = device.type == "cuda"
        self.host = (
            torch.zeros(size, dtype=torch.long, device="cpu", pin_memory=True) if cuda else self.inputs
        )
        self._sent = None  # event of the last copy out of `host` (CUDA)

    def writable(self) -> torch.Tensor:
        if self._sent is not None:
            self._sent.synchronize()  # the previous step's copy has read `host`
        return self.host

    def send(self, size: int) -> None:
        """Copy the first `size` values of `host` to `inputs` (nothing to do on the CPU)."""
        if self.host is not self.inputs:
            self.inputs[:size].copy_(self.host[:size], non_blocking=True)
            self._sent = torch.cuda.Event()
            self._sent.record()


def warm_and_capture(step, stream: torch.cuda.Stream, pool, device: torch.device) -> torch.cuda.CUDAGraph:
    """Run `step()` once on `stream` (caches that allocate on first use fill outside the graph), then
    capture it into a new graph in `pool` on that stream."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a graph captured on first use may be captured while another thread of the engine
    # (async loop, structured-output masks) issues its own CUDA work, which "global" mode forbids
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        step()
    return graph


class DecodeGraphRunner:
    """Static input buffers, one graph (or, with `capture=False`, one static metadata) per (bucket, tier).

    `runner` is the `PagedRunner` whose model and cache it drives; its cache holds one block more than
    the scheduler's `num_blocks`: block `num_blocks`, the dummy block of placeholder rows.
    """

    def __init__(self, runner, settings: DecodeGraphSettings) -> None:
        self.family = runner.family
        problem = self.family.static_problem(runner.model)
        if problem:
            raise ValueError(problem)
        self.runner = runner
        self.settings = settings
        self.device = runner.device
        if settings.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        self.plain_forward = self.family.static_forward
        self.buckets = build_graph_batch_sizes(settings.max_batch_size, settings.interval)
        self.tiers = build_context_tiers(settings.max_context, settings.min_context_tier)
        self.block_size = runner.block_size
        self.dummy_block = runner.num_blocks
        self.max_blocks = self.blocks(self.tiers[-1])
        # one int64 row per token: id, position, write slot, block table (blocks(tier) columns); flat, so
        # that the (bucket, tier) view is the buffer's first bucket x width values (one contiguous copy)
        size = self.buckets[-1] * (3 + self.max_blocks)
        self.staged = StagedInputs(size, self.device)
        self.inputs = self.staged.inputs
        self.metas: dict[tuple[int, int], StaticDecodeMetadata] = {}  # (bucket, tier), made on first use
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # every graph's output rows [largest bucket, vocab]
        self.pool = None
        self.mode = None  # (numerics mode, batch-invariant mode) the graphs were captured under
        self.captures = CaptureCounter(settings)
        self.replays = 0  # steps run through a graph (graph replays, or static steps without capture)
        self.verify_replays = 0  # those of them with a sequence feeding more than one token (drafts)

    @property
    def forward(self):
        """The static step a graph captures under the current modes: compiled (`settings.compile`) in the
        default mode, as written in batch-invariant mode (`runtime.compiled`: no bitwise guarantee)."""
        if self.settings.compile is None or batch_invariant.enabled():
            return self.plain_forward
        from .compiled import compiled_static_forward

        return compiled_static_forward(self.plain_forward, self.settings.compile)

    def blocks(self, tier: int) -> int:
        """Block-table columns of context tier `tier`."""
        return -(-tier // self.block_size)

    def _view(self, buf: torch.Tensor, b: int, tier: int) -> torch.Tensor:
        """The [b, 3 + blocks(tier)] input matrix of (bucket b, tier) at the start of `buf`."""
        width = 3 + self.blocks(tier)
        return buf[: b * width].view(b, width)

    def meta(self, b: int, tier: int) -> StaticDecodeMetadata:
        """The static metadata of (bucket b, tier): views of `inputs` (fixed addresses for a graph)."""
        key = (b, tier)
        if key not in self.metas:
            v = self._view(self.inputs, b, tier)
            self.metas[key] = StaticDecodeMetadata(
                self.block_size,
                v[:, 0],
                v[:, 1],
                v[:, 2],
                v[:, 3:],
                self.dummy_block,
                self.family.static_index,
            )
        return self.metas[key]

    # ---------------------------------------------------------------------------------------------
    def problem(self, meta: StepMetadata) -> str | None:
        """Why the step `meta` must run eagerly (None: it replays a (bucket, tier) graph)."""
        n = int(meta.offsets[-1])
        if n == 0 or int(meta.query_lens.max()) > self.settings.max_query_len:
            return f"not a decode / verification step (at most {self.settings.max_query_len} tokens per sequence)"
        if meta.host_logits_rows is None:
            return "the step's logits rows are not known on the host"
        if n > self.buckets[-1]:
            return f"{n} tokens > the largest bucket {self.buckets[-1]}"
        if int(meta.ends.max()) > self.tiers[-1]:
            return f"context {int(meta.ends.max())} > max_context {self.tiers[-1]}"
        if batch_invariant.enabled() and not self.settings.batch_invariant:
            return (
                "batch-invariant graphs are off "
                "(DecodeGraphSettings.batch_invariant; engine: DEEPINFER_CUDAGRAPH_BATCH_INVARIANT=0)"
            )
        if batch_invariant.enabled() and self.device.type == "cpu":
            problem = self.family.static_batch_invariant_problem(self.runner.model)
            if problem:
                return problem
        if self.mode is not None and graph_mode() != self.mode:
            numerics_mode, bi = self.mode
            return (
                f"graphs were captured with DEEPINFER_NUMERICS={numerics_mode}, "
                f"{batch_invariant.ENV}={int(bi)}"
            )
        return None

    def select(self, n: int) -> int:
        """The smallest bucket >= n tokens."""
        return smallest_at_least(self.buckets, n, "tokens")

    def select_tier(self, context: int) -> int:
        """The smallest context tier >= `context` tokens."""
        i = int(np.searchsorted(self.tiers, context))
        if i == len(self.tiers):
            raise ValueError(f"context {context} exceeds max_context {self.tiers[-1]}")
        return self.tiers[i]

    def key(self, meta: StepMetadata) -> tuple[int, int]:
        """(bucket, tier) of an eligible step: its token count and its longest context (after the step)."""
        return self.select(int(meta.offsets[-1])), self.select_tier(int(meta.ends.max()))

    def _fill(self, b: int, tier: int, meta: StepMetadata | None, input_ids) -> None:
        """Rows 0 .. n-1 from the step, n .. b-1 placeholders, into the (b, tier) view of `inputs`."""
        host = self.staged.writable()
        buf = self._view(host, b, tier).numpy()
        buf[:, 0] = PLACEHOLDER_TOKEN
        buf[:, 1] = 0
        buf[:, 2] = self.dummy_block * self.block_size
        buf[:, 3:] = self.dummy_block
        if meta is not None:
            n = int(meta.offsets[-1])
            buf[:n, 0] = np.asarray(input_ids, dtype=np.int64)
            buf[:n, 1] = meta.host_positions
            buf[:n, 2] = meta.host_write_slots
            # the tier covers every sequence's context, so its columns hold every block the step uses
            cols = min(meta.tables.shape[1], buf.shape[1] - 3)
            t = meta.tables[:, :cols]
            seq_of = np.repeat(np.arange(len(meta.query_lens)), meta.query_lens)  # row -> its sequence
            buf[:n, 3 : 3 + cols] = np.where(t >= 0, t, self.dummy_block)[seq_of]
        self.staged.send(buf.size)
        if meta is not None and meta.device_fed:  # ids sampled on the device: the host array has placeholders
            self._view(self.inputs, b, tier)[: len(meta.input_ids), 0].copy_(meta.input_ids)

    def run(self, meta: StepMetadata, input_ids) -> torch.Tensor:
        """FP32 logits [len(meta.logits_rows), vocab] of an eligible step (`problem(meta)` is None): the
        rows `meta.logits_rows` (packed token rows) of its (bucket, tier) graph's output."""
        b, tier = self.key(meta)
        if self.captures.due((b, tier), self.graphs):
            self._capture(b, tier)  # (fills placeholder rows: before `_fill`)
        self._fill(b, tier, meta, input_ids)
        self.replays += 1
        self.verify_replays += int(meta.query_lens.max()) > 1
        graph = self.graphs.get((b, tier))
        if graph is not None:
            graph.replay()
            out = self.logits
        else:
            out = self.forward(self.runner.model, self.meta(b, tier), self.runner.cache)
        return out[meta.logits_rows]  # a gather: a copy (the next replay overwrites `out`)

    # ---------------------------------------------------------------------------------------------
    def capture(self) -> None:
        """At start: capture every (bucket, tier), largest first, in one shared pool (CUDA, `capture_all`);
        otherwise `run` captures each on its `capture_on_use`-th use."""
        if not (self.settings.capture and self.settings.capture_all):
            return
        import time

        t0 = time.perf_counter()
        for tier in reversed(self.tiers):
            for b in reversed(self.buckets):
                self._capture(b, tier)
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode CUDA graphs (buckets %s, context tiers %s) in %.1f s",
            len(self.graphs),
            self.buckets,
            self.tiers,
            time.perf_counter() - t0,
        )

    def _capture(self, b: int, tier: int) -> None:
        """Warm up on the capture stream (caches that allocate fill first), then capture (b, tier) into
        the shared pool; the graph copies its logits into rows 0 .. b-1 of the shared `logits`."""
        if self.pool is None:
            self.mode = graph_mode()
            self.pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
            # outside the pool (it outlives every capture), FP32 as the static step's logits
            vocab = self.runner.vocab_size
            self.logits = torch.empty(self.buckets[-1], vocab, dtype=torch.float32, device=self.device)
        model, cache = self.runner.model, self.runner.cache
        self._fill(b, tier, None, None)
        meta = self.meta(b, tier)

        def step():
            self.logits[:b].copy_(self.forward(model, meta, cache))

        self.graphs[(b, tier)] = warm_and_capture(step, self._stream, self.pool, self.device)

    def destroy(self) -> None:
        """Free the graphs, their pool and the shared output (required before destroying process groups)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None
        self.logits = None
