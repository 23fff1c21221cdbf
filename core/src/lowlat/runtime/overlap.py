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
request draws from its own generator (``lowlat.runtime.sampling``) whatever else is in the batch.

Where it does not apply, ``step`` runs the plain ``Engine._run`` (after resolving the step in flight):

* PREFILL steps (a prompt chunk, or a waiting request that can be admitted): the step in flight is resolved
  first, then the prefill runs plainly; decoding overlaps again from the DECODE step after it;
* speculative decoding (``EngineConfig.speculative``): the Engine builds no OverlapLoop; ``Speculator`` owns the
  step (VERIFY acceptance needs the host values);
* ``Engine.verify`` resolves the step in flight first (``drain``).

Sampled (temperature > 0) requests overlap too, but ``sampling.sample`` uploads small host lists
(``torch.tensor(..., device=...)``), which synchronize a CUDA stream; only greedy steps are free of host syncs
until device-side sampling lands there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from lowlat.runtime import tp_launch
from lowlat.runtime.forward_batch import ForwardMode
from lowlat.runtime.sampling import sample
from lowlat.runtime.scheduler import RequestState, ScheduledStep, make_batch

__all__ = ["OverlapLoop"]


@dataclass
class InFlight:
    """One launched DECODE step whose sampled ids are not read yet.

    Attributes:
        step: the scheduled step (``requests`` in batch order).
        picked: [B] int64 sampled ids on the device (the next step's inputs gather from it).
        host: [B] int64 host tensor the ids are copied to (pinned on CUDA; ``picked`` itself on CPU).
        event: recorded after the copy (CUDA), None on CPU (the copy is done).
        t0: ``time.perf_counter()`` at launch (s).
        logits: the step's logits (a copy of an eager forward's), kept only while a ``logits_observer`` is set.
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
        n = engine.config.max_batch_size
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
        """As ``Engine._run`` on a failure: the engine is failed, every request dropped; re-raises (a TP worker's
        error, when one explains it)."""
        e = self.engine
        self.pending = None
        e._failed = exc
        e.scheduler.abort_all()
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
        """Run ``step`` on the device without reading anything back; ``prev``'s picks feed its inputs."""
        e = self.engine
        t0 = time.perf_counter()
        if prev is not None:  # the host wrote rows of prev's picks; the device replaces them by the ids
            ids = step.batch.input_ids
            if len(step.requests) == len(prev.step.requests):  # the same requests in the same order
                ids.copy_(prev.picked)
            else:
                ids.copy_(prev.picked.index_select(0, ids))
        logits = e.runner.forward(step.batch)
        if step.greedy:
            picked = torch.argmax(logits, dim=-1)
        else:
            picked = sample(logits, [r.params for r in step.requests], [r.generator for r in step.requests])
        kept = None
        if e.logits_observer is not None:  # a replay returns a fresh tensor; an eager forward_fn may not
            kept = logits if e.runner.last_graphed else logits.clone()
        if self._cuda:
            host = self._host[self._flip][:len(step.requests)]
            self._flip ^= 1
            host.copy_(picked, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = picked, None
        return InFlight(step, picked, host, event, t0, kept, e.runner.last_graphed, e.runner.last_path)

    def _resolve(self, f: InFlight) -> list[Any]:
        """Read ``f``'s ids and apply them as ``Engine._run`` does, for the requests still decoding."""
        e = self.engine
        self._wait(f.event)
        toks = f.host.tolist()
        now = time.perf_counter()
        step = f.step
        keep = [i for i, r in enumerate(step.requests) if r.state is RequestState.DECODING]
        if len(keep) != len(step.requests):  # stopped at the step before (EOS) or aborted: discard their rows
            reqs = [step.requests[i] for i in keep]
            step = replace(step, requests=reqs, sample_rows=keep, sample_reqs=reqs)
            toks = [toks[i] for i in keep]
        if not keep:
            return []
        if e.logits_observer is not None and f.logits is not None:
            e.logits_observer(step, f.logits)
        finished = e.scheduler.update_decode(step, toks, now)
        e.stats.record(ForwardMode.DECODE, now - max(f.t0, self._t_last), len(keep), graphed=f.graphed,
                       path=f.path)
        self._t_last = now
        if e.step_observer is not None:
            e.step_observer(step)
        return [e._completion(r) for r in finished] if finished else []

    def _wait(self, event: Any) -> None:
        """Wait for ``event`` (None: nothing to wait for) within ``tp_launch.tp_timeout_s()`` seconds, watching
        spawned TP workers; yields the GIL while polling (the step after it is already queued on the device).

        Raises:
            WorkerError: a worker died or the deadline passed with workers; TimeoutError: the deadline passed.
        """
        if event is None or event.query():
            return
        limit = tp_launch.tp_timeout_s()
        deadline = time.monotonic() + limit
        workers = self.engine._workers
        n = 0
        while not event.query():
            time.sleep(0)
            n += 1
            if n % 1000 == 0:
                if workers is not None:
                    workers.check()
                if time.monotonic() > deadline:
                    msg = f"a DECODE step did not finish within {limit:.0f} s (LOWLAT_TP_TIMEOUT)"
                    raise tp_launch.WorkerError(msg) if workers is not None else TimeoutError(msg)
