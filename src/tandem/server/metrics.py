"""Prometheus metrics with vLLM's names and meanings, under the `tandem:` prefix and, by default,
also under `vllm:` (the same series twice), so that dashboards, autoscalers and gateways written
for vLLM (Grafana boards, llm-d, SGLang's router) read a Tandem server unchanged. `prefixes`
(`tandem serve --metrics-prefix`) chooses.

Two sources: engine-wide figures (gauges and counters: running / waiting / paused requests, KV
usage, token counts, preemptions, prefix cache, speculation and tool counters) are read from
`AsyncLLMEngine.stats()` at scrape time by a collector; per-request latencies (TTFT, inter-token,
end-to-end, queue time) and finished-request counts are observed by the serving code as outputs
arrive. The process's own figures (`process_resident_memory_bytes`, CPU seconds, open files) come
from prometheus-client's process collector, as on a vLLM server. Each app has its own `CollectorRegistry`, so several apps can live in one process.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.engine.llm_engine import EngineStats
from tandem.outputs import RequestOutput

PREFIX = "tandem:"
PREFIXES = ("tandem:", "vllm:")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Reads the engine's figures at scrape time (gauges and monotonically growing counters)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, prefixes: tuple[str, ...] = (PREFIX,)) -> None:
        self.stats = stats
        self.model_name = model_name
        self.prefixes = prefixes

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        gauges = [("num_requests_running", "Number of requests in model execution batches.", s.num_running),
                  ("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
                  ("num_requests_paused", "Number of requests paused on a tool call.", s.num_paused),
                  ("num_sessions_held", "Sessions holding their last call's KV for their next call.",
                   s.num_held_sessions),
                  ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)]
        counters = [("prompt_tokens", "Number of prefill tokens processed.", s.num_prompt_tokens),
                    ("generation_tokens", "Number of generation tokens processed.", s.num_generation_tokens),
                    ("num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions),
                    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                     s.prefix_cache_queries),
                    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                     s.prefix_cache_hits),
                    ("spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_num_drafts),
                    ("spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_num_draft_tokens),
                    ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", s.spec_num_accepted_tokens),
                    ("session_adopted_tokens", "Context tokens a session's next call took over from its held KV.",
                     s.num_adopted_tokens),
                    ("tool_calls", "Number of tool calls executed by the engine.", s.tool_num_calls),
                    ("tool_errors", "Number of tool calls that failed or timed out.", s.tool_num_errors)]
        for prefix in self.prefixes:
            for name, doc, value in gauges:
                g = GaugeMetricFamily(prefix + name, doc, labels=["model_name"])
                g.add_metric([self.model_name], float(value))
                yield g
            for name, doc, value in counters:
                c = CounterMetricFamily(prefix + name, doc, labels=["model_name"])
                c.add_metric([self.model_name], float(value))
                yield c


class _Each:
    """One metric under several prefixes: `.labels(...)` returns a child that forwards `inc` and
    `observe` to each. `first` is the metric under the first prefix (for reads)."""

    def __init__(self, metrics: list) -> None:
        self.metrics = metrics
        self.first = metrics[0]

    def labels(self, *values: str) -> _Each:
        return _Each([m.labels(*values) for m in self.metrics])

    def inc(self, amount: float = 1.0) -> None:
        for m in self.metrics:
            m.inc(amount)

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)


class ServerMetrics:
    """The app's registry, plus the per-request observations the serving code makes."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 clock: Callable[[], float] = time.monotonic, prefixes: tuple[str, ...] = PREFIXES) -> None:
        if not prefixes or len(set(prefixes)) != len(prefixes):
            raise ValueError(f"metric prefixes must be distinct and at least one, got {prefixes}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.clock = clock
        self.prefixes = prefixes
        self.registry.register(EngineStatsCollector(stats, model_name, prefixes))
        ProcessCollector(registry=self.registry)      # process_resident_memory_bytes, CPU seconds, fds
        labels = ["model_name"]
        r = self.registry
        self.success = _Each([Counter(p + "request_success", "Count of successfully processed requests.",
                                      ["model_name", "finished_reason"], registry=r) for p in prefixes])
        self.ttft = _Each([Histogram(p + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                     labels, buckets=TTFT_BUCKETS, registry=r) for p in prefixes])
        self.itl = _Each([Histogram(p + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                    labels, buckets=ITL_BUCKETS, registry=r) for p in prefixes])
        self.e2e = _Each([Histogram(p + "e2e_request_latency_seconds",
                                    "Histogram of end to end request latency in seconds.", labels,
                                    buckets=E2E_BUCKETS, registry=r) for p in prefixes])
        self.queue = _Each([Histogram(p + "request_queue_time_seconds",
                                      "Histogram of time spent in the WAITING phase for a request.", labels,
                                      buckets=E2E_BUCKETS, registry=r) for p in prefixes])
        self._last_output_s: dict[str, float] = {}

    def observe(self, out: RequestOutput) -> None:
        """One output of one engine request (called for every output, in order)."""
        now = self.clock()
        num_new = len(out.delta_token_ids)
        last = self._last_output_s.get(out.request_id)
        if last is not None and num_new:
            per_token = (now - last) / num_new
            for _ in range(num_new):
                self.itl.labels(self.model_name).observe(per_token)
        if num_new:
            self._last_output_s[out.request_id] = now
        if out.finished:
            self._finish(out)

    def observe_abort(self, request_id: str) -> None:
        """A request the server gave up on (its client left) before it finished."""
        self._last_output_s.pop(request_id, None)
        self.success.labels(self.model_name, "abort").inc()

    def _finish(self, out: RequestOutput) -> None:
        self._last_output_s.pop(out.request_id, None)
        m = out.metrics
        self.success.labels(self.model_name, out.finish_reason or "abort").inc()
        if m.first_token_time is not None:
            self.ttft.labels(self.model_name).observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue.labels(self.model_name).observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.labels(self.model_name).observe(max(0.0, m.finished_time - m.arrival_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)
