"""The speculative step of the engine loop: draft, VERIFY, accept, roll back; or a plain DECODE step.

``Engine._step`` hands each step to ``Speculator.step`` first. When prompt work is pending it returns None and
the engine schedules PREFILL as usual; otherwise it takes the step:

1. k = ``EngineConfig.draft_tokens`` (lowered only where a request would pass ``max_context_len``): a request
   near its ``max_new_tokens`` still verifies k + 1 rows, whose tokens past the limit ``Scheduler.update``
   cuts, since the engine sets ``Scheduler.slack = k`` and every request's KV promise covers those rows; when
   the controller (``controller.Controller``) says plain decoding is faster, it runs a DECODE step instead;
2. the drafter proposes up to k ids per decoding request; shorter proposals are padded to k (a padded draft is a
   point-mass guess like any other, so exactness is untouched); when no request has a draft it runs DECODE;
3. one VERIFY step (``Scheduler.schedule_verify``: k + 1 rows per request, built into the CUDA-graph buffers, so a
   captured (batch, k + 1) graph replays, plugin or general path) runs through ``Engine._run`` with this module's
   acceptance (greedy: the argmax walk of ``verify.greedy_accept``, done on the host after one read; else
   ``verify.rejection_sample``; simulated: ``SimulatedDrafter.accept_counts``);
4. ``Scheduler.update`` appends the kept drafts plus the token after them and truncates each request's KV to
   the tokens kept (``KVPool.truncate``: pages past the kept length go back to the pool).

Greedy requests get exactly the tokens of plain greedy decoding; sampled ones tokens distributed as plain
sampling's (``verify``'s docstring has the argument and the papers).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lowlat.config import EngineConfig
from lowlat.runtime.sampling import sample
from lowlat.runtime.scheduler import ScheduledStep
from lowlat.runtime.speculative.controller import Controller
from lowlat.runtime.speculative.drafter import Drafter, Drafts
from lowlat.runtime.speculative.factory import make_drafter
from lowlat.runtime.speculative.stats import SpecStats
from lowlat.runtime.speculative.verify import rejection_sample, target_probs


def _agree_fn(ctx: Any) -> Any:
    """An all-reduce mean of a list of floats over the ranks' CPU group (None without TP)."""
    if ctx is None or ctx.tp.size < 2:
        return None
    import torch.distributed as dist

    def agree(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=ctx.cpu_group)
        return (t / ctx.tp.size).tolist()

    return agree


class Speculator:
    """Speculative decoding for one engine (see the module docstring).

    Args:
        config: the engine's configuration (``speculative`` on).
        ctx: the engine's TPContext, or None.

    Attributes:
        drafter, controller, stats (a SpecStats); k: draft tokens per step.
    """

    def __init__(self, config: EngineConfig, ctx: Any = None) -> None:
        self.config = config
        self.k = config.draft_tokens
        self.drafter: Drafter = make_drafter(config, ctx)
        self.controller = Controller(adaptive=config.speculative_adaptive, agree=_agree_fn(ctx))
        self.stats = SpecStats(method=self.drafter.name, simulated=self.drafter.simulated, k=self.k)

    def step(self, engine: Any) -> list[Any] | None:
        """Run one step of ``engine`` (an Engine, in inference mode): VERIFY or DECODE; None when prompt work is
        pending (the engine schedules that). Returns the Completions that finished."""
        sched = engine.scheduler
        if sched.prefill_pending():
            return None
        reqs = sched.decoding()
        if not reqs:
            return None
        ctx = self.config.max_context_len  # the KV promise covers k rows past max_new_tokens (Scheduler.slack)
        k = min(self.k, ctx - max(len(r.prompt_ids) + len(r.output_ids) for r in reqs))
        if k < 1 or not self.controller.speculate(len(reqs), k + 1):
            return self._decode(engine)
        t0 = time.perf_counter()
        try:
            drafts = self.drafter.propose(reqs, k)
        except BaseException as e:
            self._fail(engine, e)
        lens = [min(len(d), k) for d in drafts.tokens]
        if not any(lens):
            self.stats.no_draft_steps += 1
            return self._decode(engine, t0)
        tokens = {r.rid: (d[:k] + [d[-1] if d else r.output_ids[-1]] * (k - n))
                  for r, d, n in zip(reqs, drafts.tokens, lens)}
        t1 = time.perf_counter()
        step = sched.schedule_verify(tokens, self.config.max_verify_tokens)
        accept = _Acceptance(engine, self.drafter, drafts)
        done = engine._run(step, pick=accept)
        t2 = time.perf_counter()
        self.stats.add_verify(accept.kept, sum(lens), k, t1 - t0, t2 - t1)
        tau = 1 + sum(accept.kept) / len(accept.kept)
        if drafts.warm:
            self.controller.record(len(reqs), k + 1, t2 - t0, tau=tau)
        else:  # the drafter caught up (a prompt, or steps it sat out): keep the acceptance, measure time again
            self.controller.retry(tau)
        self._release(done)
        return done

    def _decode(self, engine: Any, t0: float | None = None) -> list[Any]:
        """A plain DECODE step (``t0``: when drafting began, for a step whose drafts were all empty)."""
        start = time.perf_counter() if t0 is None else t0
        step = engine.scheduler.schedule()
        if step is None:
            return []
        done = engine._run(step)
        dt = time.perf_counter() - start
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(step.requests)
        self.stats.decode_s += dt
        if t0 is None:  # a DECODE step that also drafted is not plain decoding's cost
            self.controller.record(len(step.requests), 1, dt)
        self._release(done)
        return done

    def _fail(self, engine: Any, e: BaseException) -> None:
        """A drafter failure fails the engine like a failed step (``Engine._run``): requests dropped, raised."""
        engine._failed = e
        engine.scheduler.abort_all()
        err = engine._worker_error()
        if err is not None:
            raise err from e
        raise e

    def _release(self, done: list[Any]) -> None:
        for c in done:
            self.drafter.release(c.request_id)

    def header(self) -> str:
        """One line naming the method (and, for simulated acceptance, that the text is not the model's)."""
        from lowlat.runtime.speculative.simulated import LABEL

        adaptive = "adaptive off-switch" if self.controller.adaptive else "always on"
        line = f"speculative: {self.drafter.name}, k={self.k} draft tokens per VERIFY step, {adaptive}"
        runner = getattr(self.drafter, "runner", None)
        if runner is not None:
            sel = runner.plugin_host.selection
            line += f"; draft model on {f'plugin {sel.plugin.name}' if sel else 'the general path'}"
        return f"{line}; {LABEL}" if self.drafter.simulated else line

    def summary(self, engine: Any = None) -> list[str]:
        """Lines for ``lowlat run`` (acceptance length, VERIFY steps per path, the off-switch)."""
        return self.stats.lines(engine.stats if engine is not None else None, self.controller)

    def as_dict(self, engine: Any = None) -> dict[str, Any]:
        return self.stats.as_dict(engine.stats if engine is not None else None, self.controller)

    def close(self) -> None:
        self.drafter.close()


class _Acceptance:
    """``Engine._run``'s ``pick`` for a speculative VERIFY step: picks per row that ``accepted_tokens`` turns into
    the kept drafts plus the token after them (row ``i * (k+1) + j``: draft j while kept, then that token, then
    -1 fillers that are never read). ``kept`` holds the drafts kept per request afterwards."""

    def __init__(self, engine: Any, drafter: Drafter, drafts: Drafts) -> None:
        self.engine = engine
        self.drafter = drafter
        self.probs = drafts.probs
        self.kept: list[int] = []

    def __call__(self, step: ScheduledStep, logits: torch.Tensor) -> list[int]:
        reqs = step.requests
        b, k1 = len(reqs), step.batch.tokens_per_req
        k = k1 - 1
        rows = logits[:b * k1]
        draft_lists = [step.drafts[r.rid] for r in reqs]
        simulated = self.drafter.simulated
        if step.greedy and (simulated or self.probs is None):
            # Greedy: one argmax over the rows and one read; the walk is k + 1 host compares per request (the
            # device form is verify.greedy_accept; on the host it costs fewer launches at these sizes).
            picks = torch.argmax(rows, dim=-1)
            self.engine._sync()
            flat = picks.tolist()
            mine = [flat[i * k1:(i + 1) * k1] for i in range(b)]
            kept = self.drafter.accept_counts(b, k) if simulated else [_kept(d, m) for d, m in zip(draft_lists, mine)]
            toks = [m[n] for m, n in zip(mine, kept)]
        else:
            view = rows.view(b, k1, logits.shape[-1])
            drafts = step.batch.input_ids[:b * k1].view(b, k1)[:, 1:]  # on the device already: pending, then drafts
            if simulated:
                n = torch.tensor(self.drafter.accept_counts(b, k), dtype=torch.int64, device=logits.device)
                token = sample(view[torch.arange(b, device=logits.device), n], [r.params for r in reqs],
                               [r.generator for r in reqs])
            else:
                p = target_probs(rows, [r.params for r in reqs for _ in range(k1)])
                q = self.probs[:, :k].to(logits.device) if self.probs is not None else None
                n, token = rejection_sample(p.view(b, k1, -1), drafts, q, [r.generator for r in reqs])
            self.engine._sync()
            kept, toks = torch.stack((n, token.to(n.dtype))).tolist()  # one device-to-host read
        self.kept = kept
        vocab = logits.shape[-1]
        out: list[int] = []
        for d, m, t in zip(draft_lists, kept, toks):
            if simulated and m < k and t == d[m]:  # the model happened to pick the draft it "rejected"
                t = (t + 1) % vocab
            out += d[:m]
            out.append(t)
            out += [-1] * (k - m)
        return out


def _kept(draft: list[int], mine: list[int]) -> int:
    """Drafts kept by greedy verification: the leading drafts equal to the row's argmax."""
    n = 0
    while n < len(draft) and draft[n] == mine[n]:
        n += 1
    return n
