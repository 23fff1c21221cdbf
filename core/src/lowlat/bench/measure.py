"""What one path measures at one depth (``DepthResult``) and the shared timing procedure of a row.

Procedure of a row (docs/benchmarks.md, "Method"): ``warmup`` untimed steps, then ``iters`` timed steps, then
``iters`` timed steps again (the same configuration timed twice shows the noise). Step ``i`` runs input set
``i % input_sets``, so consecutive steps read different requests' KV and different token ids.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lowlat.bench.config import BenchConfig, Shape
from lowlat.bench.timing import Stats, count_launches, summarize, time_steps, warm_up


@dataclass
class Measurement:
    """One row's figures at one depth.

    Attributes:
        step: per-step latency of the timed run (ms), ``repeat``: the same configuration timed again (ms).
        replay: pure ``graph.replay()`` time (ms) without the input copies, when the step replayed a CUDA graph.
        ran_on: the path that actually ran the steps ("plugin", "general", "hf"; "plugin+general" if both).
        graphed: whether the steps replayed CUDA graphs (lowlat paths; the hf peer's are inside torch.compile).
        launches: kernel launches of one eager step (see ``timing.count_launches``) and ``launches_how``;
            ``launches_error`` says why there is no count.
        compile_s: hf only: seconds from building the step to the end of warm-up (torch.compile and graph capture).
        inputs: lowlat paths: how each step's inputs reached the runner ("built": the engine's path, one packed
            upload and one KV slot write; "copied": field by field into the graph's buffers; ``input_sets``).
    """

    step: Stats
    repeat: Stats
    replay: Stats | None = None
    ran_on: str = ""
    graphed: bool = False
    launches: int | None = None
    launches_how: str | None = None
    launches_error: str | None = None
    compile_s: float | None = None
    inputs: str | None = None


@dataclass
class DepthResult:
    """A path's rows at one decoder-layer count.

    Attributes:
        path, depth: which path, how many decoder layers.
        rows: per Shape a Measurement, or a string saying why the row was skipped.
        routing: per Shape, the mean distinct experts per MoE layer (only where routing was measured).
        routing_source: what produced ``routing``.
        error: why the whole depth failed to start (then ``rows`` holds that reason for every shape).
        info: path details (plugin name and selection reason, graph count, ...).
    """

    path: str
    depth: int
    rows: dict[Shape, Measurement | str] = field(default_factory=dict)
    routing: dict[Shape, list[float]] = field(default_factory=dict)
    routing_source: str = ""
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def fail_all(self, shapes: list[Shape], reason: str) -> DepthResult:
        self.error = reason
        for s in shapes:
            self.rows.setdefault(s, reason)
        return self


def describe_error(e: BaseException, limit: int = 300) -> str:
    """One line naming the exception, cut to ``limit`` characters."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def timed_twice(run: Callable[[int], object], cfg: BenchConfig, device: torch.device,
                before: Callable[[int], object] | None = None) -> tuple[Stats, Stats]:
    """Warm up, then time ``iters`` steps twice; returns (first run, repeat) summaries in ms."""
    warm_up(run, cfg.warmup, device, before)
    first = summarize(time_steps(run, cfg.iters, device, before))
    second = summarize(time_steps(run, cfg.iters, device, before))
    return first, second


def launches_of(fn: Callable[[], object], device: torch.device, m: Measurement) -> None:
    """Fill ``m.launches`` / ``launches_how`` from one profiled call of ``fn``, or ``launches_error``."""
    try:
        m.launches, m.launches_how = count_launches(fn, device)
    except Exception as e:  # a missing count must not cost the row
        m.launches_error = describe_error(e)


def free_device_memory(device: torch.device) -> None:
    """gc, then return cached blocks to the driver (between paths, so a big model and its peer never coexist)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def fmt_row(prefix: str, shape: Shape, m: Measurement | str) -> str:
    """A progress line for one measured or skipped row."""
    if isinstance(m, str):
        return f"{prefix} {shape.label}: skipped: {m}"
    s = m.step
    extra = f", compile+warm-up {m.compile_s:.1f} s" if m.compile_s is not None else ""
    return (f"{prefix} {shape.label}: {s.median:.4f} ms (p10 {s.p10:.4f}, p90 {s.p90:.4f}; repeat "
            f"{m.repeat.median:.4f}) on {m.ran_on}{' graph' if m.graphed else ''}{extra}")
