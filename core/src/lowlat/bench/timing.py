"""Timing primitives: per-step CUDA-event timing, summaries, the copy bandwidth and kernel-launch counts.

Method (/work/.library/device/METHOD.md, "Time properly"): device work is asynchronous, so each step is
bracketed by two CUDA events recorded on the current stream and the elapsed times are read after one
synchronize at the end; warm-up steps are run and not recorded; statistics are medians and percentiles. On a
CPU, steps are timed with ``time.perf_counter`` (eager work is synchronous there).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Stats:
    """Summary of timed samples, all in milliseconds (``n`` is the sample count)."""

    median: float
    p10: float
    p90: float
    q1: float
    q3: float
    mean: float
    min: float
    max: float
    n: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ascending ``sorted_values`` by linear interpolation (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of no samples")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_ms: list[float]) -> Stats:
    """Median, p10/p90, quartiles, mean, min, max of ``samples_ms``. Raises ValueError when empty."""
    if not samples_ms:
        raise ValueError("no timing samples to summarize")
    s = sorted(float(x) for x in samples_ms)
    return Stats(median=statistics.median(s), p10=percentile(s, 10), p90=percentile(s, 90), q1=percentile(s, 25),
                 q3=percentile(s, 75), mean=statistics.fmean(s), min=s[0], max=s[-1], n=len(s))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(run: Callable[[int], object], n: int, device: torch.device,
               before: Callable[[int], object] | None = None) -> list[float]:
    """Time ``run(i)`` for i in 0..n-1, each step on its own; returns n milliseconds.

    ``before(i)``, when given, runs untimed just before step i (e.g. resetting a cache length). On CUDA each
    step is bracketed by CUDA events on the current stream (no synchronize between steps, so the host can run
    ahead as in a decode loop; host-bound steps show up as device idle time between the events); on CPU by
    ``time.perf_counter``.
    """
    if n < 1:
        raise ValueError(f"need at least one timed step, got {n}")
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            if before is not None:
                before(i)
            starts[i].record()
            run(i)
            ends[i].record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    out = []
    for i in range(n):
        if before is not None:
            before(i)
        t0 = time.perf_counter()
        run(i)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def warm_up(run: Callable[[int], object], n: int, device: torch.device,
            before: Callable[[int], object] | None = None) -> None:
    """Run ``n`` untimed steps (module load, compilation, allocator growth stay out of the numbers)."""
    for i in range(n):
        if before is not None:
            before(i)
        run(i)
    synchronize(device)


@dataclass(frozen=True)
class CopyBandwidth:
    """A device-to-device copy of ``nbytes``: bytes read plus written per copy over its median time.

    Attributes:
        nbytes: size of the copied buffer (bytes); each copy moves ``2 * nbytes``.
        ms: timing of the copies (Stats, milliseconds).
        gb_per_s: ``2 * nbytes / median`` in GB/s (1e9 bytes per second).
    """

    nbytes: int
    ms: Stats
    gb_per_s: float

    def as_dict(self) -> dict[str, object]:
        return {"nbytes": self.nbytes, "bytes_moved_per_copy": 2 * self.nbytes, "gb_per_s": self.gb_per_s,
                "ms": self.ms.as_dict()}


def copy_bandwidth(device: torch.device, nbytes: int, reps: int, warmup: int = 3) -> CopyBandwidth:
    """Measure the copy bandwidth that sets the roofline (about 4.2-4.3 TB/s on the H200 at 2 GiB, median of 20).

    Copies a random ``nbytes`` uint8 buffer into another ``reps`` times (after ``warmup`` copies); frees both.

    Raises:
        torch.OutOfMemoryError: the two buffers do not fit (lower ``nbytes``).
    """
    buffers = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)]
    try:
        buffers.append(torch.empty_like(buffers[0]))

        def copy(i: int) -> None:
            buffers[1].copy_(buffers[0])

        warm_up(copy, warmup, device)
        ms = summarize(time_steps(copy, reps, device))
    finally:
        buffers.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return CopyBandwidth(nbytes, ms, 2 * nbytes / (ms.median * 1e-3) / 1e9)


KERNELS_HOW = "CUDA kernels in a torch.profiler trace of one step (memcpy/memset excluded)"
CPU_OPS_HOW = "CPU: top-level aten ops in a torch.profiler trace of one step (no kernels on a CPU)"


def count_launches(fn: Callable[[], object], device: torch.device) -> tuple[int, str]:
    """Run ``fn()`` once under torch.profiler and count what it launched.

    Returns:
        (count, what was counted): on CUDA the device kernels the trace saw (``KERNELS_HOW``); on a CPU the
        top-level ``aten::`` ops (``CPU_OPS_HOW``), the closest CPU analogue. Sets KINETO_LOG_LEVEL=6 in
        ``os.environ`` unless it is set (see below).
    Raises:
        RuntimeError: the profiler saw no kernel on CUDA (e.g. CUPTI unavailable), so no count can be given.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # torch's profiler (kineto) prints "USDT:... profiler_start" / "profiler_stop" to stderr around every trace.
    # Kineto reads KINETO_LOG_LEVEL when the process's first trace starts; 6 is above its highest level (USDT, 5),
    # so it also hides kineto's ERROR lines (a CUDA trace without kernels still raises below). A value the user set
    # wins: KINETO_LOG_LEVEL=4 shows kineto's errors and these lines again.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.events()
    if device.type == "cuda":
        n = sum(1 for e in events if e.device_type == DeviceType.CUDA
                and not e.name.startswith(("Memcpy", "Memset", "memcpy", "memset")))
        if n == 0:
            raise RuntimeError("the profiler recorded no CUDA kernel (is CUPTI available?)")
        return n, KERNELS_HOW
    n = sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)
    return n, CPU_OPS_HOW
