"""CUDA graphs for the paged runtime's DSpark draft step, greedy and sampled, per bucket of drafting
sequences.

With decode / verification steps replayed from graphs (`cuda_graphs.DecodeGraphRunner`), an eager
drafter would leave speculative decoding host-bound. A draft of the engine's draft count
k = max_query_len - 1 replays the model family's graph-safe `static_draft` instead: its inputs are one
int64 row per sequence in a preallocated buffer (next token, last position, the `draft_main.*` slots
of its window of `sliding_window` positions, then the row's sampling columns, built on the host and
copied in one transfer), its shapes are fixed by the bucket, it makes no host sync and selects every
draft on the device. The window slots replace a block table (a draft reads only its window), so there
is no context tier.

Greedy drafts (argmax at every draft step: temperature-0 requests) replay a bucket's greedy graph.
Sampled drafts (temperature > 0, no logits processors: those read the drafts so far on the host)
replay one of its two sampled graphs, with or without the top-p / top-k sort pass: the sampling
columns (`draft_sampling.DraftSampling`) carry each row's temperature, filters and draft stream key,
and `draft_sampling.StaticDraftSampler` draws with the eager sampler's math (the same stream
uniforms, `filter_probs`, float64 q, `inverse_cdf`; greedy rows of a mixed group take the argmax),
writing q into a static float64 buffer [bucket, k, V] from which each sampled row's q is copied out
for the engine (the next draft overwrites the buffer while the engine keeps q until verification).
Tokens, confidence and q equal the eager sampled draft's bit for bit on the CPU (tested). Drafts with
logits processors stay eager.

Buckets are sequence counts (`build_graph_batch_sizes(max_num_seqs, interval)`); a draft of n
sequences replays the smallest bucket b >= n, rows n .. b-1 being placeholders (token 0 drafting after
position 0 of the reserved dummy block, whose slot 0 the runner initialises with finite keys, greedy):
each row's attention reads its own window and block only, every other op (the sampling too) is
row-wise, so a placeholder never changes a real row. Graphs are captured on their `capture_on_use`-th
use, in the decode graphs' memory pool when that exists (the two are never replayed concurrently), under
one (numerics mode, batch-invariant mode). `capture=False` (CPU tests) runs the same static step without a
graph.

The graph outputs tokens, confidence and positions (and q of sampled rows) only (what the engine reads;
FP32 logits of every draft would cost bucket x k x vocab floats): a `DraftOutput` from here has
`logits` and `hidden` None. Batch-invariant mode replays only where the decode graphs do
(`DecodeGraphSettings.batch_invariant`, the default; on the CPU also only when the drafter's experts
have the grouped FP64 operands): the static draft then computes every key tile product, bitwise the
eager batch-invariant draft (tested on the CPU).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import batch_invariant
from .cuda_graphs import (
    PLACEHOLDER_TOKEN,
    CaptureCounter,
    DecodeGraphSettings,
    StagedInputs,
    build_graph_batch_sizes,
    graph_mode,
    smallest_at_least,
    warm_and_capture,
)
from .device import to_device
from .draft_sampling import NUM_COLUMNS, DraftSampling, StaticDraftSampler, placeholder_columns


class DraftGraphRunner:
    """Static input / output buffers and one graph (or, with `capture=False`, the uncaptured static
    draft) per bucket of drafting sequences. `runner` is the `PagedRunner` (its cache holds the dummy
    block `num_blocks`); `settings` its decode graph settings (draft count = max_query_len - 1)."""

    def __init__(self, runner, settings: DecodeGraphSettings) -> None:
        self.family = family = runner.family
        problem = family.static_draft_problem(runner.model)
        if problem:
            raise ValueError(problem)
        if settings.max_query_len < 2:
            raise ValueError(
                f"draft graphs need max_query_len >= 2 (1 + nextn), got {settings.max_query_len}"
            )
        self.runner = runner
        self.settings = settings
        self.device = runner.device
        if settings.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        self.forward = family.static_draft
        self.num_draft_tokens = settings.max_query_len - 1
        self.buckets = build_graph_batch_sizes(
            max(1, settings.max_batch_size // settings.max_query_len), settings.interval
        )
        self.window = family.draft_window(runner.model)
        # one row: next token, last position, window slots, sampling columns (`draft_sampling`)
        self.width = 2 + self.window + NUM_COLUMNS
        self.vocab = runner.vocab_size
        self.dummy_slot = runner.num_blocks * runner.block_size
        size = self.buckets[-1] * self.width
        self.staged = StagedInputs(size, self.device)
        self.inputs = self.staged.inputs
        self.temperatures = torch.empty(self.num_draft_tokens, dtype=torch.float32, device=self.device)
        self._temps_host: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # greedy drafts, per bucket
        self.sampled_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # per (bucket, sort)
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # tokens, conf, pos
        # sampled drafts: q of every row and draft step, the inverse CDF's cumulative weights (float64
        # [bucket, k, V] and [bucket, V], made on the first sampled draft)
        self.q: torch.Tensor | None = None
        self.cdf: torch.Tensor | None = None
        self.pool = None
        self.mode = None
        self.captures = CaptureCounter(settings)
        self.replays = 0  # drafts run through the static path (graph replays, or uncaptured)
        self.sampled_replays = 0  # of which sampled
        # the placeholders' window key: finite (a never-written pool slot is NaN); nothing real reads
        # the dummy block, and decode placeholders only ever write finite keys there
        cache = runner.cache
        for name in family.draft_pools(runner.model):
            cache.pools[name][self.dummy_slot].zero_()

    def _view(self, buf: torch.Tensor, b: int) -> torch.Tensor:
        return buf[: b * self.width].view(b, self.width)

    def problem(self, num_seqs: int, num_draft_tokens: int) -> str | None:
        """Why a draft of `num_seqs` sequences and `num_draft_tokens` tokens runs eagerly (None: it
        replays a bucket's graph, greedy or sampled)."""
        if num_draft_tokens != self.num_draft_tokens:
            return f"draft count {num_draft_tokens} != the graphs' {self.num_draft_tokens}"
        if not 1 <= num_seqs <= self.buckets[-1]:
            return f"{num_seqs} drafting sequences outside [1, {self.buckets[-1]}]"
        if batch_invariant.enabled():
            if not self.settings.batch_invariant:
                return "batch-invariant graphs are off (DecodeGraphSettings.batch_invariant)"
            if self.device.type == "cpu":
                problem = self.family.static_batch_invariant_problem(self.runner.model, drafter=True)
                if problem:
                    return problem
        if self.mode is not None and graph_mode() != self.mode:
            return "draft graphs were captured under another numerics / batch-invariant mode"
        return None

    def select(self, n: int) -> int:
        """The smallest bucket >= n sequences."""
        return smallest_at_least(self.buckets, n, "sequences")

    def _fill(
        self, b: int, tokens=None, last=None, slots=None, sampling: DraftSampling | None = None
    ) -> None:
        """Rows 0 .. n-1 from the draft, n .. b-1 placeholders, into the bucket-b view of `inputs` (the
        sampling columns from `sampling`, greedy without it); the confidence temperatures (env, read per
        draft) into their buffer when they changed."""
        temps = self.family.draft_temperatures(self.num_draft_tokens)
        if self._temps_host is None or not torch.equal(temps, self._temps_host):
            self.temperatures.copy_(temps)  # rare (an env change): a plain synchronous copy
            self._temps_host = temps
        host = self.staged.writable()
        buf = self._view(host, b).numpy()
        w = 2 + self.window
        buf[:, 0] = PLACEHOLDER_TOKEN
        buf[:, 1] = 0
        buf[:, 2:w] = self.dummy_slot
        buf[:, w:] = placeholder_columns(self.vocab)
        if tokens is not None:
            n = len(tokens)
            buf[:n, 0] = tokens
            buf[:n, 1] = last
            buf[:n, 2:w] = slots
            if sampling is not None:
                buf[:n, w:] = sampling.columns(self.vocab)
        self.staged.send(buf.size)

    def _static(self, b: int, sort: bool | None = None):
        """The static draft of bucket b on the views of `inputs` (fixed addresses for a graph): greedy
        (`sort` None), or sampled from the sampling columns into rows 0 .. b-1 of `q` (`sort`: with the
        top-p / top-k pass)."""
        v = self._view(self.inputs, b)
        pick = None
        if sort is not None:
            w = 2 + self.window
            pick = StaticDraftSampler(v[:, w:], self.q[:b], self.cdf[:b], sort)
        return self.forward(
            self.runner.model,
            self.runner.cache,
            v[:, 0],
            v[:, 1],
            v[:, 2 : 2 + self.window],
            self.num_draft_tokens,
            self.temperatures,
            pick,
        )

    def run(self, meta, seqs: np.ndarray, tokens: list[int], last: np.ndarray, sampling=None) -> list:
        """`DraftOutput`s (tokens, confidence, positions; logits and hidden None) of an eligible draft
        (`problem` None): sequences `seqs` of the step `meta`, after positions `last` (validated); greedy,
        or drawn as `sampling` (`DraftSampling`, one row per sequence) says, each sampled row's q in its
        output's `probs`."""
        n = len(seqs)
        b = self.select(n)
        sort = None
        if sampling is not None:
            if len(sampling.params) != n:
                raise ValueError(f"sampling has {len(sampling.params)} rows for {n} drafting sequences")
            sort = sampling.needs_sort(self.vocab)
            self._sampling_buffers()
        graphs, key = (self.graphs, b) if sort is None else (self.sampled_graphs, (b, sort))
        if self.captures.due(key, graphs):
            self._capture(b, sort)
        slots = self.family.draft_window_slots(meta, np.asarray(seqs, dtype=np.int64), last, self.window)
        self._fill(b, np.asarray(tokens, dtype=np.int64), last, slots, sampling)
        self.replays += 1
        self.sampled_replays += sort is not None
        graph = graphs.get(key)
        if graph is not None:
            graph.replay()
            tok, conf, pos = (t[:n] for t in self.outputs)
        else:
            tok, _, conf, _, pos = self._static(b, sort)
            tok, conf, pos = tok[:n], conf[:n], pos[:n]
        tok, conf, pos = tok.clone(), conf.clone(), pos.clone()  # the next replay overwrites the outputs
        probs = [None] * n
        if sampling is not None:
            probs = self._sampled_q(sampling.sampled, probs)
        return [self.family.draft_output(tok[k], conf[k], pos[k], probs[k]) for k in range(n)]

    def _sampling_buffers(self) -> None:
        if self.q is None:
            bmax, k = self.buckets[-1], self.num_draft_tokens
            self.q = torch.zeros(bmax, k, self.vocab, dtype=torch.float64, device=self.device)
            self.cdf = torch.zeros(bmax, self.vocab, dtype=torch.float64, device=self.device)

    def _sampled_q(self, sampled: np.ndarray, probs: list) -> list:
        """q [k, V] of each sampled row, copied out of `q` (which the next draft overwrites, while the
        engine keeps q until the drafts are verified), the rows one after the other in one tensor as the
        eager sampler keeps them (`cat_rows` reads them in place)."""
        rows = np.flatnonzero(sampled)
        if len(rows) == len(sampled):
            kept = self.q[: len(rows)].clone()
        else:
            kept = self.q.index_select(0, to_device(rows, self.device, torch.long))  # (no host sync)
        for m, row in enumerate(rows):
            probs[row] = kept[m]
        return probs

    def _capture(self, b: int, sort: bool | None = None) -> None:
        """Warm up on the capture stream, then capture bucket b (greedy, or sampled with / without the
        sort pass) into the (decode graphs') pool; the graph copies its tokens, confidence and positions
        into rows 0 .. b-1 of the shared outputs (a sampled graph writes q into `q` itself)."""
        if self.pool is None:
            self.mode = graph_mode()
            decode = self.runner.graphs
            self.pool = getattr(decode, "pool", None) or torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
            bmax, k = self.buckets[-1], self.num_draft_tokens
            self.outputs = (
                torch.zeros(bmax, k, dtype=torch.long, device=self.device),
                torch.zeros(bmax, k, dtype=torch.float32, device=self.device),
                torch.zeros(bmax, k, dtype=torch.long, device=self.device),
            )
        self._fill(b)

        def step():
            tok, _, conf, _, pos = self._static(b, sort)
            for out, val in zip(self.outputs, (tok, conf, pos)):
                out[:b].copy_(val)

        graph = warm_and_capture(step, self._stream, self.pool, self.device)
        if sort is None:
            self.graphs[b] = graph
        else:
            self.sampled_graphs[(b, sort)] = graph

    def destroy(self) -> None:
        """Free the graphs and their outputs (before process groups are destroyed)."""
        for graph in (*self.graphs.values(), *self.sampled_graphs.values()):
            graph.reset()
        self.graphs.clear()
        self.sampled_graphs.clear()
        self.pool = None
        self.outputs = None
        self.q = self.cdf = None
