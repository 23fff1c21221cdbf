"""Prometheus metrics of one server, on a registry of its own (``/metrics`` serves it as text).

Names follow vLLM's where one exists (``vllm:time_to_first_token_seconds`` -> ``lowlat_time_to_first_token_seconds``).
Updated from the engine loop thread (steps, finished requests) and the HTTP side (rejections); prometheus-client's
metrics are thread-safe. With speculative decoding on, ``lowlat_spec_*`` (``SpecCollector``) are read from the
engine's ``Speculator`` at scrape time (``lowlat bench serve`` diffs them around a concurrency level).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
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

    def bind_speculative(self, speculator: Any) -> None:
        """Serve ``lowlat_spec_*`` from ``speculator`` (the engine's ``Speculator``) from now on."""
        self.registry.register(SpecCollector(speculator))

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


class SpecCollector:
    """``lowlat_spec_*``: a Speculator's totals (``SpecStats``) and off-switch state, read when scraped.

    Counters (``_total``): verify_steps, request_steps (requests summed over VERIFY steps), drafted_tokens,
    accepted_tokens, emitted_tokens (appended by VERIFY steps: kept drafts plus the token after them),
    decode_steps and decode_tokens (plain DECODE steps of the speculative loop), and draft / verify / decode
    seconds. Gauges: ``lowlat_spec_on`` (1 while the off-switch lets speculation run), ``lowlat_spec_info``
    (1, labelled with the method, k and whether acceptance is simulated), ``lowlat_spec_acceptance_length``
    (the mean since start, ``SpecStats.acceptance_length``) and ``lowlat_spec_acceptance_rate``. A window's
    acceptance length is the difference of two scrapes' emitted_tokens over that of their request_steps. The
    engine thread updates these plain ints and floats between steps; a scrape reads each one whole.
    """

    COUNTERS = (("verify_steps", "verify_steps", "speculative VERIFY steps"),
                ("request_steps", "request_steps", "requests summed over speculative VERIFY steps"),
                ("drafted_tokens", "drafted", "draft tokens proposed (padding excluded)"),
                ("accepted_tokens", "accepted", "draft tokens the verifier kept"),
                ("emitted_tokens", "emitted", "tokens VERIFY steps appended (kept drafts plus the token after them)"),
                ("decode_steps", "decode_steps", "plain DECODE steps of the speculative loop"),
                ("decode_tokens", "decode_tokens", "tokens those DECODE steps appended"),
                ("draft_seconds", "draft_s", "host seconds drafting"),
                ("verify_seconds", "verify_s", "host seconds in speculative VERIFY steps"),
                ("decode_seconds", "decode_s", "host seconds in the speculative loop's DECODE steps"))

    def __init__(self, speculator: Any) -> None:
        self.speculator = speculator

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        s, c = self.speculator.stats, self.speculator.controller
        info = GaugeMetricFamily("lowlat_spec_info", "speculative decoding: method, k, simulated acceptance",
                                 labels=["method", "k", "simulated"])
        info.add_metric([s.method, str(s.k), str(s.simulated).lower()], 1.0)
        yield info
        yield GaugeMetricFamily("lowlat_spec_on", "1 while the adaptive off-switch lets speculation run",
                                value=float(c.on))
        yield GaugeMetricFamily("lowlat_spec_acceptance_length",
                                "mean tokens a VERIFY step appended per request since start, the bonus token "
                                "included (emitted_tokens / request_steps; 0 before any)", value=s.acceptance_length)
        yield GaugeMetricFamily("lowlat_spec_acceptance_rate",
                                "draft tokens kept over draft tokens proposed since start (0 before any)",
                                value=s.acceptance_rate)
        for name, attr, doc in self.COUNTERS:
            yield CounterMetricFamily(f"lowlat_spec_{name}", doc, value=float(getattr(s, attr)))
