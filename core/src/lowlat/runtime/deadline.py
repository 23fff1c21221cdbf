"""Step deadlines: every step runs under a watchdog, so a forward that never returns cannot hang the engine.

A Python thread cannot be killed, so the watchdog does not try: the step runs on one persistent worker
thread (``lowlat-step``) and the caller waits for it with a timeout. When the deadline passes the caller
raises StepDeadlineExceeded, the watchdog is marked broken and its thread is *abandoned* (a daemon: it
finishes or blocks on its own, and whatever it returns is dropped). The engine that owns a broken watchdog
is unusable and says so; with tensor parallelism it also stops every rank (``Engine``), which unblocks a
thread stuck in a collective.

The handoff costs one queue put and one lock wait per step (~30 µs measured on a busy 2-core CPU), paid
on the host while the device works; a step's own exceptions (any BaseException, SystemExit included) are
re-raised in the caller. Thread-local state the step needs is set on the worker thread: the CUDA device,
and inference mode, which ``ModelRunner.forward`` enters itself.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class StepDeadlineExceeded(RuntimeError):
    """A step (or a cross-rank wait inside it) did not finish within its deadline; the engine is unusable."""


class _Job:
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Lock()  # held until the step finished (a bare lock: cheaper than an Event)
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None


class StepWatchdog:
    """Run callables with a deadline on a persistent worker thread.

    Args:
        timeout_s: the deadline of each ``run``, in seconds (> 0).
        device: the device steps run on (its CUDA device is made current on the worker thread).
    Attributes:
        broken: the StepDeadlineExceeded that abandoned the thread, or None.
    """

    def __init__(self, timeout_s: float, device: torch.device | None = None) -> None:
        self.timeout_s = float(timeout_s)
        self.device = device
        self.broken: StepDeadlineExceeded | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], T], describe: Callable[[], str]) -> T:
        """``fn()`` on the worker thread; its result, or its exception re-raised here.

        Args:
            describe: called only on a missed deadline; says what was running (step, plugin, ranks).
        Raises:
            StepDeadlineExceeded: ``fn`` did not return within ``timeout_s`` s (message: ``describe()``, the
                deadline and the settings that control it); every later ``run`` raises it again.
        """
        if self.broken is not None:
            raise StepDeadlineExceeded(f"this engine is unusable after an earlier missed deadline: {self.broken}")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="lowlat-step", daemon=True)
            self._thread.start()
        job = _Job(fn)
        self._jobs.put(job)
        if not job.done.acquire(timeout=self.timeout_s):
            self.broken = StepDeadlineExceeded(
                f"{describe()} did not finish within {self.timeout_s:g} s (the step deadline: EngineConfig."
                f"step_timeout_s, --step-timeout or LOWLAT_STEP_TIMEOUT); the step was abandoned and this engine "
                f"is unusable: close it and create a new one (raise the deadline if such steps are expected)")
            self._thread = None  # abandoned; a daemon, it never blocks interpreter exit
            raise self.broken
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[no-any-return]

    def close(self, join_s: float = 10.0) -> None:
        """Let the worker thread exit and wait up to ``join_s`` seconds for it (idempotent; an abandoned thread is
        left to itself). Joining matters at process exit: a worker still unwinding its native thread state while the
        interpreter finalizes can abort the process (``terminate called without an active exception``, seen with
        Triton's interpreter)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(join_s)
            self._thread = None

    def _loop(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                job.result = job.fn()
            except BaseException as e:  # re-raised in the caller, SystemExit and KeyboardInterrupt too
                job.error = e
            job.done.release()
            if self.broken is not None:
                return


def wait_for_device_watching(workers: Any) -> None:
    """Wait for the current CUDA stream's work while checking the TP workers (spawned mode).

    Raises:
        WorkerError: a worker failed, or the work did not finish within LOWLAT_TP_TIMEOUT seconds.
    """
    import time

    from lowlat.runtime import tp_launch

    event = torch.cuda.Event()
    event.record()
    deadline = time.monotonic() + tp_launch.tp_timeout_s()
    n = 0
    while not event.query():
        n += 1
        if n % 1000 == 0:
            workers.check()
            if time.monotonic() > deadline:
                raise tp_launch.WorkerError(f"a TP step did not finish within {tp_launch.tp_timeout_s():.0f} s "
                                            "(LOWLAT_TP_TIMEOUT seconds)")
