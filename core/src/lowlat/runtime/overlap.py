"""The overlapped step loop: the host schedules step N+1 while the device runs step N.

After the idea of SGLang's overlap ("zero-overhead") scheduler (python/sglang/srt/managers/scheduler.py,
``event_loop_overlap``, and tp_worker_overlap_thread.py; "SGLang v0.4: Zero-Overhead Batch Scheduler", LMSYS
blog, 2024-12-04). This is a single-threaded, single-stream take on it, written for lowlat's Engine:

1. ``launch(N)``: build step N's batch, run ``ModelRunner.forward`` and the sampler (argmax when greedy) and keep
   the sampled ids **on the device**; start a non-blocking copy of them to pinned host memory and record an event
   behind it. Nothing waits for the device.
2. Before reading step N's ids, launch step N+1 over the same requests: each request's position and KV slot are
   known on the host (one past step N's), and its input id is step N's pick, copied on the device into the
   batch's ``input_ids`` (the CUDA graph's fixed input buffer, so the replay needs no host value). The host
   mirror's ``input_ids`` carry the row of each request in step N's picks; one ``index_select`` on the device
   turns them into token ids after the batch upload, in stream order before the forward (a plain copy when the
   requests are step N's, in its order: step N+1's requests are always step N's minus some, in order).
3. ``resolve(N)``: wait (with a deadline) for step N's event, read the ids (one step late) and apply them as
   ``Engine._run`` does: ``Scheduler.update_decode``, stop checks (EOS, length), stats, ``logits_observer``,
   ``step_observer``, completions. The host does this, and everything the caller does before the next
   ``Engine.step()`` (the server drains its queue), while the device runs step N+1.

Stop behaviour is that of plain decoding. A request that reaches ``max_new_tokens`` at step N is known to stop on
the host and is left out of step N+1. A request that emits EOS at step N was already in step N+1: that row is
computed and discarded (its token never reaches ``output_ids`` or an observer), and its KV slot goes back to the
pool with the rest of the request when it finishes (``KVPool.free_req``), so pages and outputs match plain
decoding. Aborted requests are dropped the same way. Greedy ids are identical; sampled ones too, because each
request draws from its own generator (``lowlat.runtime.sampling``) whatever else is in the batch. One caveat: the
step after an EOS stop holds one row more than the plain step does, and where kernels are not batch-invariant
(bf16 GEMMs pick tiles by batch size) a near-tie in that step may resolve differently, as it may whenever
continuous batching changes a batch.

Where it does not apply, ``step`` runs the plain ``Engine._run`` (after resolving the step in flight):

* PREFILL steps (a prompt chunk, or a waiting request that can be admitted): the step in flight is resolved
  first, then the prefill runs plainly; decoding overlaps again from the DECODE step after it;
* speculative decoding (``EngineConfig.speculative``): the Engine builds no OverlapLoop; ``Speculator`` owns the
  step (VERIFY acceptance needs the host values);
* ``Engine.verify`` resolves the step in flight first (``drain``).

Sampled (temperature > 0) requests overlap too: ``sampling.sample`` queues its kernels without a host sync (its
small host lists go up with non-blocking copies).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from lowlat.forward_batch import ForwardMode
from lowlat.runtime.deadline import StepDeadlineExceeded
from lowlat.runtime.sampling import sample
from lowlat.runtime.scheduler import RequestState, ScheduledStep, make_batch
from lowlat.runtime.step_guard import checked_picks, describe_step, is_ids, packed_ids, packed_picks

__all__ = ["OverlapLoop"]


@dataclass
class InFlight:
    """One launched DECODE step whose sampled ids are not read yet.

    Attributes:
        step: the scheduled step (``requests`` in batch order).
        picked: [B] int64 sampled ids on the device (the next step's inputs gather from it).
        host: [2B] int64 host tensor: the ids, then a "row is all finite" flag each (``step_guard.packed_picks``;
            pinned on CUDA, where the copy into it is non-blocking).
        event: recorded after the copy (CUDA), None on CPU (the copy is done).
        t0: ``time.perf_counter()`` at launch (s).
        logits: the step's logits (a copy of an eager forward's), kept only while a ``logits_observer`` is set and
            the step needs them (``Engine.logits_needed``; the observer sees only such steps).
        graphed, path: what ``ModelRunner.forward`` did (``last_graphed``, ``last_path``).
    """

    step: ScheduledStep
    picked: torch.Tensor
    host: torch.Tensor
    event: Any
    t0: float
    logits: torch.Tensor | None
    graphed: bool
    path: str


class OverlapLoop:
    """The overlapped DECODE loop of one Engine (see the module docstring).

    Args:
        engine: the Engine (its runner, scheduler, observers, stats and TP workers are used; not modified
            otherwise). Every TP rank runs its own OverlapLoop: ranks read identical ids, so their schedules agree.

    Attributes:
        pending: the step in flight, or None.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.pending: InFlight | None = None
        device = engine.runner.device
        self._cuda = device.type == "cuda"
        n = 2 * engine.config.max_batch_size
        # Two pinned buffers: step N+1's copy may land while the host still reads step N's ids.
        self._host = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(2)] if self._cuda else []
        self._flip = 0
        self._t_last = 0.0  # perf_counter of the latest resolve (s)

    def step(self) -> list[Any]:
        """One ``Engine.step()``: launch the next step, then resolve the one before it.

        Returns:
            The Completions that finished in the resolved step (or in a plain PREFILL step).
        """
        e = self.engine
        prev = self.pending
        if prev is None:
            step = e.scheduler.schedule()
            if step is None:
                return []
            if step.mode is not ForwardMode.DECODE:
                return e._run(step)  # the plain step (it handles its own failures)
        try:
            if prev is None:
                prev = self.pending = self._launch(step, None)
            nxt = self._next_step(prev)
            self.pending = self._launch(nxt, prev) if nxt is not None else None
            finished = self._resolve(prev)
        except BaseException as exc:
            self._fail(exc)
        if self.pending is not None and not any(r.state is RequestState.DECODING for r in self.pending.step.requests):
            self.pending = None  # every request of it stopped or was aborted: nothing of it is kept
        return finished

    def drain(self) -> list[Any]:
        """Resolve the step in flight, if any; returns the Completions that finished in it."""
        prev, self.pending = self.pending, None
        try:
            return self._resolve(prev) if prev is not None else []
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """As ``Engine._run`` on a failure: the engine is failed, every request dropped; a missed deadline stops
        every TP rank; re-raises (a TP worker's error, when one explains it)."""
        e = self.engine
        self.pending = None
        e._failed = exc
        e.scheduler.abort_all()
        if isinstance(exc, StepDeadlineExceeded) and e._workers is not None:
            e._workers.close(timeout=1.0)  # frees a thread stuck in a collective
            e._workers = None
            raise exc
        err = e._worker_error()
        if err is not None:
            raise err from exc
        raise exc

    def discard(self) -> None:
        """Forget the step in flight without reading it (after a failure, or at close)."""
        self.pending = None

    # -- internals -------------------------------------------------------------------------------------------

    def _next_step(self, prev: InFlight) -> ScheduledStep | None:
        """The DECODE step after ``prev`` on the host values known now, or None when plain scheduling must decide
        (prompt work pending, nothing left to decode)."""
        sched = self.engine.scheduler
        if sched.prefill_pending():
            return None
        index: dict[int, int] = {}
        live = []
        for i, r in enumerate(prev.step.requests):
            # After prev, r holds len(output_ids) + 1 tokens; it goes on unless that reaches max_new_tokens.
            if r.state is RequestState.DECODING and len(r.output_ids) + 1 < r.params.max_new_tokens:
                index[r.rid] = i
                live.append(r)
        if not live:
            return None
        rows = [r.row for r in live]
        prefix = [r.num_computed + 1 for r in live]  # prev's token is cached by prev itself
        rows_in_prev = [index[r.rid] for r in live]  # placeholders: the device turns them into token ids
        if sched.builder.fits(len(live), 1):
            batch = sched.builder.build(ForwardMode.DECODE, rows, prefix, rows_in_prev, 1)
        else:
            batch = make_batch(sched.pool, ForwardMode.DECODE, rows, prefix, [[i] for i in rows_in_prev])
        return ScheduledStep(ForwardMode.DECODE, live, batch, list(range(len(live))), live,
                             greedy=all(r.params.greedy for r in live))

    def _launch(self, step: ScheduledStep, prev: InFlight | None) -> InFlight:
        """Run ``step`` on the device without reading anything back; ``prev``'s picks feed its inputs.

        The launch runs under the engine's step deadline (``Engine._watchdog``, ``lowlat.runtime.deadline``), as a
        plain step's forward does: on CPU, or in a blocking collective, the launch is where a step can hang. A
        CUDA-graph replay on one device is enqueued on this thread instead (``_inline``): it runs no model or
        plugin code on the host, so nothing in it can block, and the device side keeps its deadline in
        ``_wait``. That saves the watchdog's two thread switches per step, which fall between the batch upload
        and the graph launch, where the device waits for them at batch 1 (H200:
        bench/results/2026-12-01-h200-overlap-diag).
        """
        e = self.engine
        t0 = time.perf_counter()
        e.attach_sampling(step)  # a sampling plugin may return the ids (plugin API 3); host work only
        if self._inline(step):
            return self._enqueue(step, prev, t0)
        return e._watchdog.run(lambda: self._enqueue(step, prev, t0), lambda: e._describe_stuck(step))

    def _inline(self, step: ScheduledStep) -> bool:
        """Whether ``step`` is a CUDA-graph replay on a single device (no TP workers): enqueued on this thread."""
        e = self.engine
        return self._cuda and e._workers is None and e.config.tp_size == 1 and e.runner.will_replay(step.batch)

    def _enqueue(self, step: ScheduledStep, prev: InFlight | None, t0: float) -> InFlight:
        if not torch.is_inference_mode_enabled():  # the watchdog's thread: inference mode is thread-local
            with torch.inference_mode():
                return self._enqueue(step, prev, t0)
        e = self.engine
        if prev is not None:  # the host wrote rows of prev's picks; the device replaces them by the ids
            ids = step.batch.input_ids
            if len(step.requests) == len(prev.step.requests):  # the same requests in the same order
                ids.copy_(prev.picked)
            else:
                ids.copy_(prev.picked.index_select(0, ids))
        # Logits are kept for the observer only when the step needs them (``Engine.wants_logits``); otherwise
        # every read of the output is queued below, before the next replay: it is read in place, not copied.
        wants = e.wants_logits(step)
        logits = e.runner.forward(step.batch, fresh=wants)
        kept = None
        if is_ids(logits):  # its -1 flags non-finite logits: the guard rides on the same read
            # the next step feeds on the picks: a flagged row feeds 0 (never an id the embedding cannot index)
            packed, picked = packed_ids(logits, e.model_config.vocab_size)
        else:
            if wants:  # a replay returned a fresh tensor; an eager forward_fn may not
                kept = logits if e.runner.last_graphed else logits.clone()
            if step.greedy:  # argmax and the non-finite guard in one pass (lowlat.kernels.pick on CUDA)
                packed = packed_picks(logits)
                picked = packed[: logits.shape[0]]
            else:
                picked = sample(logits, [r.params for r in step.requests], [r.generator for r in step.requests])
                packed = packed_picks(logits, picked)  # the non-finite guard rides on the same read
        if self._cuda:
            host = self._host[self._flip][:packed.numel()]
            self._flip ^= 1
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = packed, None
        return InFlight(step, picked, host, event, t0, kept, e.runner.last_graphed, e.runner.last_path)

    def _resolve(self, f: InFlight) -> list[Any]:
        """Read ``f``'s ids and apply them as ``Engine._run`` does, for the requests still decoding."""
        e = self.engine
        self._wait(f)
        out = f.host.tolist()
        now = time.perf_counter()
        step = f.step
        keep = [i for i, r in enumerate(step.requests) if r.state is RequestState.DECODING]
        if len(keep) != len(step.requests):  # stopped at the step before (EOS) or aborted: discard their rows
            if not keep:
                return []
            reqs = [step.requests[i] for i in keep]
            step = replace(step, requests=reqs, sample_rows=keep, sample_reqs=reqs)
            n = len(out) // 2
            out = [out[i] for i in keep] + [out[n + i] for i in keep]
        toks = checked_picks(out, lambda: describe_step(step, e.runner, e._steps_run + 1), e.runner.check_peer)
        if e.logits_observer is not None and f.logits is not None:
            e.logits_observer(step, f.logits)
        finished = e.scheduler.update_decode(step, toks, now)
        e._steps_run += 1  # as Engine._run: the per-rank step counters a missed deadline reports
        if e._ctx is not None and e._ctx.progress is not None:
            e._ctx.progress[e.rank] = e._steps_run
        e.stats.record(ForwardMode.DECODE, now - max(f.t0, self._t_last), len(keep), graphed=f.graphed,
                       path=f.path)
        self._t_last = now
        if e.step_observer is not None:
            e.step_observer(step)
        return [e._completion(r) for r in finished] if finished else []

    def _wait(self, f: InFlight) -> None:
        """Wait for ``f``'s event (CPU: none) within the step deadline (``EngineConfig.resolved_step_timeout_s``),
        watching spawned TP workers; yields the GIL while polling (the step after it is already queued).

        Raises:
            WorkerError: a worker failed; StepDeadlineExceeded: the deadline passed (the engine is unusable).
        """
        event = f.event
        if event is None or event.query():
            return
        e = self.engine
        limit = e.config.resolved_step_timeout_s
        deadline = time.monotonic() + limit
        workers = e._workers
        n = 0
        while not event.query():
            time.sleep(0)
            n += 1
            if n % 1000 == 0:
                if workers is not None:
                    workers.check()
                if time.monotonic() > deadline:
                    raise StepDeadlineExceeded(
                        f"{e._describe_stuck(f.step)} did not finish on the device within {limit:g} s (the step "
                        "deadline: EngineConfig.step_timeout_s, --step-timeout or LOWLAT_STEP_TIMEOUT); this engine "
                        "is unusable: close it and create a new one")
