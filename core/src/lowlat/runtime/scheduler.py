"""The continuous-batching scheduler (its requests and steps: ``lowlat.runtime.request``).

After nano-vllm's scheduler (nanovllm/engine/scheduler.py): requests wait in FIFO order, join the running
set between steps while a request row, the batch limit and KV pages allow, and leave as soon as they finish.
Each step is either a PREFILL step (prompt tokens; long prompts in chunks, at most ``chunked_prefill_size``
tokens per step in total) or a DECODE step (one token for every request whose prompt is done); prefill
work goes first. The scheduler is deterministic: the same requests added in the same order give the same
steps on every tensor-parallel rank, which is what keeps the ranks in lockstep.

KV pages are promised at admission: a request is admitted only when the pool can hold its whole life
(prompt plus ``max_new_tokens`` - 1 cached tokens) on top of what the running requests may still take,
so a step never runs out of pages and no request is ever preempted.

DECODE and VERIFY batches are built into preallocated buffers (``lowlat.runtime.step_inputs.BatchBuilder``): the
batch of a step aliases them and is valid until the next step is scheduled. The list of decoding requests is
kept between steps and rebuilt only when the running set or a request's state changes.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool
from lowlat.runtime.request import Request, RequestState, ScheduledStep, accepted_tokens
from lowlat.runtime.step_inputs import BatchBuilder, StepInputs, make_batch

__all__ = ["Request", "RequestState", "ScheduledStep", "Scheduler", "accepted_tokens", "make_batch"]


class _DecodeView(NamedTuple):
    """The running set as DECODE steps see it; rebuilt when a request is admitted, finishes a prompt or leaves."""

    decoding: list[Request]  # DECODING requests, in running order
    rows: list[int]  # their req_to_token rows
    sample_rows: list[int]  # 0..len(decoding)-1
    greedy: bool  # every decoding request is greedy
    prefilling: bool  # some running request is PREFILLING


class Scheduler:
    """Continuous batching over one KV pool (see the module docstring for the policy).

    Args:
        pool: the KV pool (one request row of it is kept by the engine as the dummy row).
        max_batch_size: requests admitted at once.
        chunked_prefill_size: prompt tokens per PREFILL step at most.
        inputs: the StepInputs DECODE and VERIFY batches are built into (the ModelRunner's, shared with its CUDA
            graphs); None allocates DECODE-only buffers for ``max_batch_size`` requests here.

    Attributes:
        slack: extra cached tokens promised to every request on top of ``max_cached_tokens`` (0; a speculative
            engine sets k, so a VERIFY step of k + 1 rows may run past a request's ``max_new_tokens``: the tokens
            past it are cut by ``update``, and their KV slots are inside the request's promise).
    """

    def __init__(self, pool: KVPool, *, max_batch_size: int, chunked_prefill_size: int,
                 inputs: StepInputs | None = None) -> None:
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        if inputs is None:  # no CUDA graphs read these: the padding row value is never used
            inputs = StepInputs(device=pool.device, max_batch_size=max_batch_size, max_tokens_per_req=1, dummy_row=0)
        self.builder = BatchBuilder(pool, inputs)
        self._view: _DecodeView | None = None
        self.slack = 0  # cached tokens a request may hold past max_cached_tokens (speculative VERIFY rows)

    @property
    def usable_pages(self) -> int:
        """Pages requests can ever hold (page 0 is reserved)."""
        return self.pool.num_slots // self.pool.page_size - 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def check_fits(self, rid: int, max_cached_tokens: int) -> None:
        """Raise ValueError when a request caching up to ``max_cached_tokens`` could never fit in the pool."""
        max_cached_tokens += self.slack
        need = self._pages(max_cached_tokens)
        if need > self.usable_pages:
            raise ValueError(
                f"request {rid} needs {max_cached_tokens} cached tokens ({need} pages) but the KV pool "
                f"holds {self.usable_pages} pages of {self.pool.page_size}; shorten the prompt or max_new_tokens, "
                "or give the KV pool more memory"
            )

    def add(self, req: Request) -> None:
        """Queue ``req``. Raises ValueError when its whole life could never fit in the KV pool."""
        self.check_fits(req.rid, req.max_cached_tokens)
        self.waiting.append(req)

    def schedule(self) -> ScheduledStep | None:
        """The next step: a PREFILL step when any prompt work can run, else a DECODE step, else None."""
        view = self._view or self._make_view()
        if self.waiting or view.prefilling:
            step = self._schedule_prefill()
            if step is not None:
                return step
        decoding = view.decoding
        if not decoding:
            return None
        batch = self._build(ForwardMode.DECODE, decoding, view.rows, [r.output_ids[-1] for r in decoding], 1)
        return ScheduledStep(ForwardMode.DECODE, decoding, batch, view.sample_rows, decoding, greedy=view.greedy)

    def prefill_pending(self) -> bool:
        """Whether ``schedule()`` would return a PREFILL step now (a prompt in progress, or one admissible)."""
        if (self._view or self._make_view()).prefilling:
            return True
        return bool(self.waiting) and self._can_admit(self.waiting[0])

    def decoding(self) -> list[Request]:
        """The DECODING requests, in the order a DECODE step batches them (do not modify the list)."""
        return (self._view or self._make_view()).decoding

    def check_verify(self, drafts: dict[int, list[int]], max_tokens_per_req: int) -> list[Request]:
        """Validate a VERIFY request; returns the requests in ``drafts`` order.

        Raises:
            ValueError: no drafts, an id is not a decoding request, the k differ, k+1 exceeds
                ``max_tokens_per_req``, or k+1 new tokens could pass a request's ``max_new_tokens``.
        """
        if not drafts:
            raise ValueError("VERIFY needs draft tokens for at least one decoding request")
        by_id = {r.rid: r for r in self.running if r.state is RequestState.DECODING}
        lens = {len(t) for t in drafts.values()}
        if len(lens) != 1:
            raise ValueError(f"every request in a VERIFY step needs the same number of draft tokens, got {lens}")
        k = lens.pop()
        if k + 1 > max_tokens_per_req:
            raise ValueError(f"{k} draft tokens make {k + 1} tokens per request, above max_verify_tokens="
                             f"{max_tokens_per_req}; send fewer drafts or raise max_verify_tokens")
        reqs = []
        for rid in drafts:
            r = by_id.get(rid)
            if r is None:
                raise ValueError(f"request {rid} is not decoding; VERIFY runs on requests whose prompt is done")
            if len(r.output_ids) + k + 1 > r.params.max_new_tokens + self.slack:
                raise ValueError(
                    f"request {rid} has {len(r.output_ids)} of max_new_tokens={r.params.max_new_tokens} tokens; "
                    f"{k} draft tokens could pass that limit"
                )
            reqs.append(r)
        return reqs

    def schedule_verify(self, drafts: dict[int, list[int]], max_tokens_per_req: int) -> ScheduledStep:
        """A VERIFY step: each listed DECODING request feeds its pending token plus its k draft tokens.

        Args:
            drafts: request id -> k draft token ids (the same k for all).
            max_tokens_per_req: the largest k+1 allowed (EngineConfig.max_verify_tokens).

        Raises:
            ValueError: see ``check_verify``.
        """
        reqs = self.check_verify(drafts, max_tokens_per_req)
        k1 = len(next(iter(drafts.values()))) + 1
        tokens = [t for r in reqs for t in (r.output_ids[-1], *drafts[r.rid])]
        batch = self._build(ForwardMode.VERIFY, reqs, [r.row for r in reqs], tokens, k1)
        return ScheduledStep(ForwardMode.VERIFY, reqs, batch, list(range(k1 * len(reqs))),
                             [r for r in reqs for _ in range(k1)], drafts={r.rid: list(drafts[r.rid]) for r in reqs},
                             greedy=all(r.params.greedy for r in reqs))

    def update(self, step: ScheduledStep, new_tokens: dict[int, list[int]], now: float) -> list[Request]:
        """Apply a step's results and retire finished requests.

        Args:
            step: the step that ran.
            new_tokens: request id -> tokens accepted this step (PREFILL/DECODE: one for each sampled request;
                VERIFY: accepted drafts plus the bonus token).
            now: ``time.perf_counter()`` after the step.

        Returns:
            The requests that finished, whose KV rows and pages are back in the pool.
        """
        for r in step.requests:
            if step.mode is ForwardMode.PREFILL:
                r.num_computed = self.pool.num_allocated(r.row)
                if r.prompt_left == 0:
                    r.state = RequestState.DECODING
                    self._view = None
            else:
                r.num_computed += len(new_tokens.get(r.rid, ())) if step.mode is ForwardMode.VERIFY else 1
                if step.mode is ForwardMode.VERIFY:
                    self.pool.truncate(r.row, r.num_computed)
        finished = []
        for r in step.requests:
            toks = new_tokens.get(r.rid)
            if not toks:
                continue
            if r.t_first_token is None:
                r.t_first_token = now
            for t in toks:
                r.output_ids.append(t)
                if r.params.stop_at_eos and t in r.eos_ids:
                    r.finish_reason = "eos"
                elif len(r.output_ids) >= r.params.max_new_tokens:
                    r.finish_reason = "length"
                if r.finish_reason:
                    break
            if r.finish_reason:
                self._finish(r, now)
                finished.append(r)
        return finished

    def update_decode(self, step: ScheduledStep, tokens: list[int], now: float) -> list[Request]:
        """``update`` for a DECODE step, with ``tokens[i]`` the token of ``step.requests[i]`` (same result).

        Raises:
            ValueError: ``step`` is not a DECODE step or ``tokens`` does not have one token per request.
        """
        if step.mode is not ForwardMode.DECODE or len(tokens) != len(step.requests):
            raise ValueError(f"update_decode takes a DECODE step and one token per request, got {step.mode.name} "
                             f"with {len(step.requests)} requests and {len(tokens)} tokens")
        finished = []
        for r, t in zip(step.requests, tokens):
            r.num_computed += 1
            if r.t_first_token is None:
                r.t_first_token = now
            out = r.output_ids
            out.append(t)
            if r.params.stop_at_eos and t in r.eos_ids:
                r.finish_reason = "eos"
            elif len(out) >= r.params.max_new_tokens:
                r.finish_reason = "length"
            else:
                continue
            self._finish(r, now)
            finished.append(r)
        return finished

    def abort(self, rid: int) -> bool:
        """Drop request ``rid`` (waiting or running) and give its KV back; False when it is not here."""
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                r.state, r.finish_reason = RequestState.FINISHED, "abort"
                return True
        for r in self.running:
            if r.rid == rid:
                r.finish_reason = "abort"
                self._finish(r, 0.0)
                return True
        return False

    def abort_all(self) -> None:
        """Drop every request and give its KV back (after a failed step)."""
        for r in list(self.running):
            self._finish(r, 0.0)
        self.waiting.clear()

    # -- internals -------------------------------------------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.pool.page_size)

    def _make_view(self) -> _DecodeView:
        decoding = [r for r in self.running if r.state is RequestState.DECODING]
        self._view = _DecodeView(decoding, [r.row for r in decoding], list(range(len(decoding))),
                                 all(r.params.greedy for r in decoding),
                                 any(r.state is RequestState.PREFILLING for r in self.running))
        return self._view

    def _build(self, mode: ForwardMode, reqs: list[Request], rows: list[int], tokens: list[int],
               tokens_per_req: int) -> ForwardBatch:
        """The DECODE/VERIFY batch of ``reqs`` feeding ``tokens`` (flat): built incrementally when it fits."""
        prefix = [r.num_computed for r in reqs]
        if self.builder.fits(len(reqs), tokens_per_req):
            return self.builder.build(mode, rows, prefix, tokens, tokens_per_req)
        k = tokens_per_req
        return make_batch(self.pool, mode, rows, prefix, [tokens[i * k:(i + 1) * k] for i in range(len(reqs))])

    def _promised_pages(self) -> int:
        """Pages the running requests may still allocate."""
        return sum(self._pages(r.max_cached_tokens + self.slack) - self._pages(self.pool.num_allocated(r.row))
                   for r in self.running)

    def _can_admit(self, req: Request) -> bool:
        if len(self.running) >= self.max_batch_size or self.pool.free_rows == 0:
            return False
        return self._pages(req.max_cached_tokens + self.slack) <= self.pool.free_pages - self._promised_pages()

    def _schedule_prefill(self) -> ScheduledStep | None:
        budget = self.chunked_prefill_size
        reqs: list[Request] = []
        chunks: list[int] = []
        for r in self.running:
            if r.state is RequestState.PREFILLING and budget > 0:
                n = min(r.prompt_left, budget)
                reqs.append(r)
                chunks.append(n)
                budget -= n
        while budget > 0 and self.waiting and self._can_admit(self.waiting[0]):
            r = self.waiting.popleft()
            r.row = self.pool.alloc_req()
            r.state = RequestState.PREFILLING
            self.running.append(r)
            self._view = None
            n = min(r.prompt_left, budget)
            reqs.append(r)
            chunks.append(n)
            budget -= n
        if not reqs:
            return None
        prefix = [r.num_computed for r in reqs]
        batch = make_batch(self.pool, ForwardMode.PREFILL, [r.row for r in reqs], prefix,
                           [r.prompt_ids[p:p + n] for r, p, n in zip(reqs, prefix, chunks)])
        done = [i for i, (r, p, n) in enumerate(zip(reqs, prefix, chunks)) if p + n == len(r.prompt_ids)]
        sample_reqs = [reqs[i] for i in done]
        return ScheduledStep(ForwardMode.PREFILL, reqs, batch, done, sample_reqs,
                             greedy=all(r.params.greedy for r in sample_reqs))

    def _finish(self, r: Request, now: float) -> None:
        r.state = RequestState.FINISHED
        r.t_finish = now
        if r.row is not None:
            self.pool.free_req(r.row)
            r.row = None
        self.running.remove(r)
        self._view = None
