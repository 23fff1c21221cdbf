"""Prometheus metrics of one server, on a registry of its own (``/metrics`` serves it as text).

Names follow vLLM's where one exists (``vllm:time_to_first_token_seconds`` -> ``lowlat_time_to_first_token_seconds``).
Updated from the engine loop thread (steps, finished requests) and the HTTP side (rejections); prometheus-client's
metrics are thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                0.1, 0.2, 0.5, 1.0, 2.5)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    """The server's counters, histograms and gauges."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lowlat_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("lowlat_requests_rejected", "Requests refused before running, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("lowlat_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("lowlat_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.ttft = Histogram("lowlat_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("lowlat_time_per_output_token_seconds", "Mean time between a request's tokens",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("lowlat_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.steps = Counter("lowlat_steps", "Engine steps by forward mode and path (general or plugin)",
                             ["mode", "path"], registry=r)
        self.queue_depth = Gauge("lowlat_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("lowlat_running_requests", "Requests in flight (queued or running)", registry=r)

    def bind(self, queue_depth: Callable[[], float], running: Callable[[], float]) -> None:
        """Gauges read at scrape time."""
        self.queue_depth.set_function(queue_depth)
        self.running.set_function(running)

    def on_step(self, mode: str, path: str) -> None:
        self.steps.labels(mode, path).inc()

    def on_finish(self, finish: str, prompt_tokens: int, completion_tokens: int, t_submit: float,
                  t_first: float | None, t_end: float) -> None:
        self.requests.labels(finish).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(t_end - t_submit)
        if t_first is not None:
            self.ttft.observe(t_first - t_submit)
            if completion_tokens > 1:
                self.tpot.observe((t_end - t_first) / (completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
