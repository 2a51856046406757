"""Prometheus metrics of a server: the engine's state read at scrape time, latencies as tokens are delivered.

Gauges and counters of the engine come from `AsyncLLM.engine_stats` (read between steps, so a scrape never
touches the scheduler during one); TTFT, inter-token latency and request latency are histograms fed by
`AsyncLLM`'s delivery listener. Each server has its own registry.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..async_llm import AsyncLLM
from ..outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0  # tokens/s is measured over this trailing window


class ServerMetrics:
    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm, self.model_name = llm, model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds",
            "Arrival to the first token delivered",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "deepinfer_inter_token_latency_seconds",
            "Time between tokens delivered to a request (a step that delivers k tokens counts k gaps of 1/k)",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "deepinfer_e2e_request_latency_seconds",
            "Arrival to the last token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "deepinfer_request_success",
            "Requests finished, by finish reason",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(self))
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last RATE_WINDOW_S
        llm.listeners.append(self.on_delivery)

    def on_delivery(self, out: RequestOutput, new_tokens: int, gap: float | None, now: float) -> None:
        if new_tokens == 0:
            pass
        elif gap is None:
            self.ttft.labels(self.model_name).observe(now - out.metrics.arrival_time)
        else:
            for _ in range(new_tokens):
                self.itl.labels(self.model_name).observe(gap / new_tokens)
        self._recent.append((now, new_tokens))
        if out.finished:
            self.e2e.labels(self.model_name).observe(now - out.metrics.arrival_time)
            for c in out.outputs:
                self.finished.labels(self.model_name, c.finish_reason or "unknown").inc()

    def tokens_per_second(self) -> float:
        now = time.perf_counter()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's gauges and counters, as of its last step."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        llm, model = self.metrics.llm, self.metrics.model_name
        stats = llm.engine_stats
        sched = stats.get("scheduler", {})

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([model], float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([model], float(value))
            return c

        yield gauge(
            "deepinfer_num_requests_running",
            "Sequences the scheduler is running",
            sched.get("num_running", 0),
        )
        yield gauge(
            "deepinfer_num_requests_waiting",
            "Sequences waiting in the scheduler, plus requests not yet handed to it",
            sched.get("num_waiting", 0) + llm.num_queued,
        )
        yield gauge(
            "deepinfer_kv_cache_usage_ratio",
            "Fraction of KV blocks in use (0..1)",
            sched.get("kv_usage", 0.0),
        )
        yield gauge(
            "deepinfer_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / prompt tokens looked up (0..1)",
            sched.get("prefix_cache_hit_rate", 0.0),
        )
        yield gauge(
            "deepinfer_generation_tokens_per_second",
            f"Tokens delivered per second over the last {RATE_WINDOW_S:g} s",
            self.metrics.tokens_per_second(),
        )
        yield counter("deepinfer_prompt_tokens", "Prompt tokens admitted", stats.get("prompt_tokens", 0))
        yield counter("deepinfer_generation_tokens", "Tokens generated", stats.get("generated_tokens", 0))
        yield counter("deepinfer_num_preemptions", "Sequences preempted", sched.get("num_preemptions", 0))
        if "draft_tokens" in stats:
            drafted, accepted = stats["draft_tokens"], stats["accepted_draft_tokens"]
            yield counter("deepinfer_spec_decode_num_draft_tokens", "Draft tokens verified", drafted)
            yield counter("deepinfer_spec_decode_num_accepted_tokens", "Draft tokens accepted", accepted)
            yield gauge(
                "deepinfer_spec_decode_draft_acceptance_rate",
                "Accepted / verified draft tokens (0..1)",
                accepted / drafted if drafted else 0.0,
            )
