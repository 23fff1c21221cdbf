"""The one thread that owns the Engine: a request queue in, one stream of deltas out per request.

The HTTP side calls ``submit`` (thread-safe, never blocks) and reads the returned ``RequestStream`` with
``await stream.get(timeout)``; it calls ``abort`` when its client goes away. The loop thread drains the command
queue between steps, so new requests join the running batch at the next step (continuous batching) and an
aborted request's KV pages are free before the next step runs. After each step the engine's ``step_observer``
hands the loop the step's requests; their new token ids (checked for stop token ids) go to each request's stream,
all streams' deltas with one wake-up of the event loop. Text is made on the reading side: ``RequestStream.get``
detokenizes incrementally (``IncrementalDetokenizer``) and applies stop strings (a hit aborts the request, one
step late at most), so the loop thread's host work per step stays O(1) per request while the reader's runs
during the next GPU step (``.tolist()`` releases the GIL while it waits for the device). With the overlapped loop
(``lowlat.runtime.overlap``, on by default on CUDA) the observer, the command drain and the deltas run while the
device computes the step after the one they report; an abort then also drops that step's row of the request.

Bounds: at most ``max_queued`` requests wait for a batch slot (``submit`` raises ``Overloaded`` beyond it);
each request may carry a deadline (it is aborted and its stream ends with ``finish_reason="timeout"``);
``stop(grace_s)`` refuses new requests, lets running ones finish within the grace period, aborts the rest
and closes the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from lowlat.serve.streams import Delta, GenRequest, RequestStream, TokenLogprob, deliver

FINISH_REASONS = {"eos": "stop", "length": "length", "abort": "abort"}
IDLE_WAIT_S = 0.05


class Overloaded(RuntimeError):
    """Too many requests wait for a batch slot (HTTP 503 with Retry-After)."""


class NotAccepting(RuntimeError):
    """The server is shutting down or its engine failed (HTTP 503)."""


@dataclass
class _State:
    handle: int
    req: GenRequest
    stream: RequestStream
    t_submit: float
    deadline: float | None
    rid: int = -1
    seen: int = 0  # output ids already handled
    admitted: bool = False
    t_first: float | None = None
    pending_lp: dict[int, Any] = field(default_factory=dict)  # sample row logprobs, by position
    completion: int = 0  # tokens generated up to the end (a stop token included)
    engine_done: bool = False  # the engine retired it (EOS or length): nothing to abort there
    done: bool = False


class EngineLoop:
    """Owns ``engine`` on a thread of its own (see the module docstring).

    Args:
        engine: a started ``lowlat.runtime.Engine``; nothing else may call it once ``start`` ran.
        max_queued: requests that may wait for a batch slot.
        metrics: a ``ServeMetrics`` (or None).

    Attributes read by the HTTP side (fixed at construction): ``tokenizer``, ``max_context_len``,
    ``vocab_size``, ``max_cached_tokens``, ``serving_path`` (which path serves the model:
    ``PluginHost.describe``'s plugin, summary and skipped).
    """

    def __init__(self, engine: Any, *, max_queued: int = 256, metrics: Any = None) -> None:
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.max_context_len = engine.config.max_context_len
        self.vocab_size = engine.model_config.vocab_size
        pool = engine.scheduler.pool
        self.max_cached_tokens = engine.scheduler.usable_pages * pool.page_size  # one request's KV at most
        self.serving_path = engine.runner.plugin_host.describe(engine.config.plugin)
        self.max_queued = max_queued
        self.metrics = metrics
        if metrics is not None and getattr(engine, "speculator", None) is not None:
            metrics.bind_speculative(engine.speculator)  # lowlat_spec_* on /metrics
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._in_flight = 0
        self._ids = itertools.count()
        self._accepting = True
        self._stop_at: float | None = None
        self._by_rid: dict[int, _State] = {}
        self._by_handle: dict[int, _State] = {}
        self._to_abort: list[_State] = []
        self._outbox: list[tuple[RequestStream, Delta]] = []  # deltas of this step, sent in one batch
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="lowlat-engine-loop", daemon=True)

    # -- the HTTP side ---------------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Requests submitted and not yet in a batch."""
        return self._pending

    @property
    def in_flight(self) -> int:
        """Requests submitted whose stream has not ended."""
        return self._in_flight

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.failed is None and self._accepting

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: GenRequest, stream: RequestStream) -> int:
        """Queue ``req``; its deltas go to ``stream``. Returns the handle for ``abort``.

        Raises:
            Overloaded: ``max_queued`` requests already wait. NotAccepting: shutting down or failed.
        """
        with self._lock:
            if not self._accepting or self.failed is not None or not self._thread.is_alive():
                raise NotAccepting("the server is shutting down" if not self._accepting else
                                   f"the engine failed: {self.failed}")
            if self._pending >= self.max_queued:
                raise Overloaded(f"{self._pending} requests are waiting (--max-queued-requests {self.max_queued})")
            self._pending += 1
            self._in_flight += 1
            handle = next(self._ids)
        stream.handle, stream.owner, stream.prompt_tokens = handle, self, len(req.prompt_ids)
        now = time.monotonic()
        deadline = None if req.timeout_s is None else now + req.timeout_s
        self._cmds.put(("add", _State(handle, req, stream, now, deadline)))
        return handle

    def abort(self, handle: int, finish: str = "abort") -> None:
        """End the request with ``finish`` (the client went away: "abort"; a stop string: "stop") and free its
        KV pages before the next step; a finished one is left alone. Thread-safe."""
        self._cmds.put(("abort", (handle, finish)))

    def refuse_new(self) -> None:
        """From now on ``submit`` raises NotAccepting; running requests go on."""
        with self._lock:
            self._accepting = False

    def stop(self, grace_s: float = 30.0, join_s: float = 60.0) -> None:
        """Refuse new requests; finish running ones within ``grace_s``; abort the rest; close the engine."""
        with self._lock:
            self._accepting = False
        self._cmds.put(("stop", time.monotonic() + grace_s))
        if self._thread.is_alive():
            self._thread.join(grace_s + join_s)

    # -- the loop thread -------------------------------------------------------------------------------------

    def _main(self) -> None:
        e = self._engine
        if e.runner is not None and e.runner.device.type == "cuda":
            import torch

            torch.cuda.set_device(e.runner.device)
        e.step_observer = self._on_step
        e.logits_observer = self._on_logits
        e.logits_needed = self._wants_logprobs  # else a sampling plugin may return ids (plugin API 3)
        try:
            while True:
                busy = e.has_unfinished()
                self._drain(0.0 if busy else IDLE_WAIT_S)
                self._expire()
                if self._stop_at is not None and (not self._by_handle or time.monotonic() > self._stop_at):
                    for st in list(self._by_handle.values()):
                        self._end(st, "abort", error="the server shut down before the request finished")
                    self._abort_dropped()
                    return
                if e.has_unfinished():
                    finished = e.step()
                    for c in finished:
                        st = self._by_rid.get(c.request_id)
                        if st is not None and not st.done:  # finished without new tokens this step (rare)
                            st.engine_done = True
                            self._end(st, FINISH_REASONS.get(c.finish_reason, c.finish_reason))
                    self._abort_dropped()
        except BaseException as exc:  # a failed step: every stream ends with the error
            self.failed = exc
            for st in list(self._by_handle.values()):
                self._end(st, "error", error=f"{type(exc).__name__}: {exc}")
            self._flush()
        finally:
            e.step_observer = e.logits_observer = e.logits_needed = None
            e.close(abort=self.failed is not None)

    def _drain(self, wait_s: float) -> None:
        try:
            cmd = self._cmds.get(timeout=wait_s) if wait_s > 0 else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = cmd
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                st = self._by_handle.get(arg[0])
                if st is not None:
                    self._end(st, arg[1])
                    self._abort_dropped()
            elif kind == "stop":
                self._stop_at = arg
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _add(self, st: _State) -> None:
        self._by_handle[st.handle] = st
        try:
            st.rid = self._engine.add_request(st.req.prompt_ids, st.req.params)
        except ValueError as exc:  # validated on the HTTP side already; this is the engine's last word
            self._end(st, "invalid", error=str(exc))
            return
        self._by_rid[st.rid] = st

    def _expire(self) -> None:
        now = time.monotonic()
        for st in [s for s in self._by_handle.values() if s.deadline is not None and now > s.deadline]:
            self._end(st, "timeout", error=f"the request did not finish within its timeout of {st.req.timeout_s} s")
        self._abort_dropped()

    def _flush(self) -> None:
        """Send the collected deltas: one wake-up per event loop per step, not one per request."""
        if not self._outbox:
            return
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list[tuple[RequestStream, Delta]]]] = {}
        for item in self._outbox:
            by_loop.setdefault(id(item[0]._aloop), (item[0]._aloop, []))[1].append(item)
        self._outbox = []
        for aloop, items in by_loop.values():
            deliver(aloop, items)

    def _abort_dropped(self) -> None:
        """Abort in the engine every request that ended here but still runs there (frees its KV pages now);
        then send the collected deltas."""
        self._flush()
        while self._to_abort:
            st = self._to_abort.pop()
            if st.rid >= 0:
                self._engine.abort(st.rid)

    def _wants_logprobs(self, step: Any) -> bool:
        """Whether a request of ``step`` asked for logprobs (its logits must reach ``_on_logits``)."""
        return any((st := self._by_rid.get(r.rid)) is not None and st.req.logprobs is not None
                   for r in step.sample_reqs)

    def _on_logits(self, step: Any, logits: Any) -> None:
        if not any(st.req.logprobs is not None for st in self._by_handle.values()):
            return
        import torch

        for row, r in zip(step.sample_rows, step.sample_reqs):
            st = self._by_rid.get(r.rid)
            if st is None or st.req.logprobs is None:
                continue
            lp = torch.log_softmax(logits[row].float(), dim=-1)
            k = max(st.req.logprobs, 1)
            vals, idx = torch.topk(lp, k)
            st.pending_lp[len(st.pending_lp)] = (lp, list(zip(idx.tolist(), vals.tolist())))

    def _on_step(self, step: Any) -> None:
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.on_step(step.mode.name, self._engine.runner.last_path)
        for r in step.requests:
            st = self._by_rid.get(r.rid)
            if st is None or st.done:
                continue
            if not st.admitted:
                st.admitted = True
                with self._lock:
                    self._pending -= 1
            new = r.output_ids[st.seen:]
            if not new:
                continue
            st.seen = len(r.output_ids)
            if st.t_first is None:
                st.t_first = now
            self._emit(st, new, r.finish_reason)

    def _emit(self, st: _State, new: list[int], engine_finish: str | None) -> None:
        finish = None
        st.engine_done = engine_finish is not None
        stop_at = next((i for i, t in enumerate(new) if t in st.req.stop_token_ids), None)
        if stop_at is not None:
            new, finish = new[:stop_at + 1], "stop"
        lps = None
        if st.req.logprobs is not None:
            rows = [st.pending_lp.pop(i) for i in sorted(st.pending_lp)]
            lps = [TokenLogprob(t, float(lp[t]), top[:st.req.logprobs]) for t, (lp, top) in zip(new, rows)]
        if finish is None and engine_finish is not None:
            finish = FINISH_REASONS.get(engine_finish, engine_finish)
        st.completion += len(new)
        if finish is None:
            self._outbox.append((st.stream, Delta("", new, lps)))
            return
        self._end(st, finish, last=Delta("", new, lps, stop_token=stop_at is not None))

    def _end(self, st: _State, finish: str, *, error: str | None = None, last: Delta | None = None) -> None:
        """End ``st``'s stream with ``finish``; a request still running in the engine is aborted after the step."""
        if st.done:
            return
        st.done = True
        d = last or Delta("", [])
        d.finish_reason, d.error = finish, error
        d.prompt_tokens, d.completion_tokens = len(st.req.prompt_ids), st.completion
        self._outbox.append((st.stream, d))
        self._by_handle.pop(st.handle, None)
        self._by_rid.pop(st.rid, None)
        with self._lock:
            self._in_flight -= 1
            if not st.admitted:
                self._pending -= 1
                st.admitted = True
        if not st.engine_done and st.rid >= 0:
            self._to_abort.append(st)
        if self.metrics is not None:
            self.metrics.on_finish(finish, d.prompt_tokens, d.completion_tokens, st.t_submit, st.t_first,
                                   time.monotonic())
