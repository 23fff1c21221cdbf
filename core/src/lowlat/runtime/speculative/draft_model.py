"""The draft-model drafter: a smaller checkpoint with the target's vocabulary proposes k tokens sequentially.

The draft model runs on the same runtime as the target: its own ModelRunner (so its own KV pool, CUDA graphs of
DECODE steps and plugin selection, with the engine's ``plugin`` setting) on the same device and TP group. Per
request it keeps a row of its pool and the tokens it cached there. A propose call

1. rolls the row back to the longest prefix of its cached tokens the request still has (drafts the verifier
   rejected are cut: ``KVPool.truncate`` frees their pages) and feeds what is missing. In the steady state
   that is the token the verifier appended after the kept drafts, plus the last draft when all k were kept:
   the drafter always feeds the last two tokens (recomputing one cached position when only one is missing), so
   every request has the same shape, a VERIFY step of 2 rows (a captured graph, plugin-capable). A new
   request's prompt makes it a PREFILL step;
2. takes k - 1 DECODE steps (graph replays), each feeding the drafts just picked straight from the device;
   the k drafts are read back to the host once, at the end.

Draft tokens are the argmax for greedy requests and samples of the draft distribution ``q`` (the request's own
temperature / top-k / top-p on the draft logits, with a generator of the drafter's seeded from the request's
seed) otherwise; ``q`` goes to rejection sampling (``verify.rejection_sample``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from lowlat.config import EngineConfig
from lowlat.forward_batch import ForwardMode
from lowlat.runtime.model_runner import ModelRunner
from lowlat.runtime.sampling import make_generator
from lowlat.runtime.scheduler import Request
from lowlat.runtime.speculative.drafter import Drafter, Drafts, request_seed
from lowlat.runtime.speculative.verify import target_probs
from lowlat.runtime.step_inputs import BatchBuilder, make_batch


@dataclasses.dataclass
class _State:
    row: int  # the request's row of the draft pool
    fed: list[int]  # tokens whose K/V the draft pool holds (positions 0..len-1)
    real: int  # fed[:real] are the request's own tokens; fed[real:] are drafts, maybe rejected since
    generator: torch.Generator | None


def _token_at(req: Request, pos: int) -> int:
    n = len(req.prompt_ids)
    return req.prompt_ids[pos] if pos < n else req.output_ids[pos - n]


class DraftModelDrafter(Drafter):
    """Draft tokens from a smaller model (see the module docstring).

    Args:
        config: the engine's configuration; the draft runner copies its device, dtype, TP size, page size, batch
            and context limits, CUDA graphs and plugin setting.
        path: the draft checkpoint directory or preset.
        ctx: the engine's TPContext (None without TP).

    Attributes:
        runner: the draft ModelRunner; states: request id -> its draft KV row and cached tokens;
        initial_free_pages: the draft pool's free pages with no request in it.
    """

    def __init__(self, config: EngineConfig, path: str, ctx: Any = None) -> None:
        self.name = f"draft:{path}"
        self.seed = config.seed
        draft_config = dataclasses.replace(
            config, model=path, speculative=False, speculative_method=None, num_draft_tokens=None,
            max_verify_tokens=2, num_layers=None)  # DECODE, VERIFY of 2 rows, PREFILL
        self.runner = ModelRunner(draft_config, tp=ctx.tp if ctx else None, device=ctx.device if ctx else None,
                                  cpu_group=ctx.cpu_group if ctx else None)
        self.pool = self.runner.kv_pool
        self.builder = BatchBuilder(self.pool, self.runner.step_inputs)
        self.initial_free_pages = self.pool.free_pages
        self.states: dict[int, _State] = {}

    def propose(self, requests: Sequence[Request], k: int) -> Drafts:
        self._sweep(requests)
        states = [self._sync(r) for r in requests]
        totals = [len(r.prompt_ids) + len(r.output_ids) for r in requests]
        if all(t - len(st.fed) <= 2 for st, t in zip(states, totals)) and self.builder.fits(len(states), 2):
            for st, t in zip(states, totals):  # steady state: refeed the last two tokens, one (B, 2) shape
                self._cut(st, t - 2)
        feeds = [[_token_at(r, p) for p in range(len(st.fed), t)] for r, st, t in zip(requests, states, totals)]
        warm = all(len(f) <= 2 for f in feeds)
        logits = self._forward(states, feeds)
        for st, f in zip(states, feeds):
            st.fed += f
            st.real = len(st.fed)
        params = [r.params for r in requests]
        sampled = not all(p.greedy for p in params)
        picks: list[torch.Tensor] = []
        probs = []
        for j in range(k):
            if j:  # feed the draft just picked, on the device: no host round trip between draft steps
                logits = self._decode(states, j - 1, picks[-1])
            if sampled:
                q = target_probs(logits, params)  # [B, V]: the draft distribution
                picks.append(self._sample(q, states))
                probs.append(q)
            else:
                picks.append(torch.argmax(logits, dim=-1))
        tokens = torch.stack(picks, dim=1).tolist()  # the one device-to-host read of the k draft steps
        for st, t in zip(states, tokens):
            st.fed += t[:k - 1]
        return Drafts(tokens, torch.stack(probs, dim=1) if sampled else None, warm=warm)

    def release(self, rid: int) -> None:
        st = self.states.pop(rid, None)
        if st is not None and self.pool is not None:
            self.pool.free_req(st.row)

    def close(self) -> None:
        for rid in list(self.states):
            self.release(rid)
        if self.runner is not None:
            self.runner.close()
        self.runner = None
        self.pool = None

    # -- internals -------------------------------------------------------------------------------------------

    def _sweep(self, requests: Sequence[Request]) -> None:
        """Free the rows of requests that left without a ``release`` (aborted, or finished elsewhere), before a
        new request takes a row: the pool has a row per batch slot only."""
        if len(self.states) > len(requests) or any(r.rid not in self.states for r in requests):
            live = {r.rid for r in requests}
            for rid in [rid for rid in self.states if rid not in live]:
                self.release(rid)

    def _sync(self, req: Request) -> _State:
        """The request's state, its cache cut to the longest prefix of its tokens it still agrees with."""
        st = self.states.get(req.rid)
        if st is None:
            gen = None if req.params.greedy else make_generator(request_seed(req, self.seed) ^ 0xD1AF7,
                                                                self.runner.device)
            st = self.states[req.rid] = _State(self.pool.alloc_req(), [], 0, gen)
        total = len(req.prompt_ids) + len(req.output_ids)
        keep = min(len(st.fed), total - 1)  # the pending token (output_ids[-1]) is always fed
        for p in range(st.real, keep):  # at most k - 1 drafts to check
            if st.fed[p] != _token_at(req, p):
                keep = p
                break
        self._cut(st, keep)  # also when the pool holds more than was fed (after a failed forward)
        st.real = keep
        return st

    def _cut(self, st: _State, n: int) -> None:
        """Forget the request's cached positions >= n (their pages go back to the draft pool)."""
        if len(st.fed) > n or self.pool.num_allocated(st.row) > n:
            del st.fed[n:]
            self.pool.truncate(st.row, n)
            st.real = min(st.real, n)

    def _forward(self, states: list[_State], feeds: list[list[int]]) -> torch.Tensor:
        """Feed each request its missing tokens; [B, V] float32 logits of each request's last fed token.

        Two tokens each (the steady state): a VERIFY step of 2 rows (captured graph, plugin coverage); otherwise
        (a new request's prompt) a PREFILL step.
        """
        rows = [st.row for st in states]
        prefix = [len(st.fed) for st in states]
        if all(len(f) == 2 for f in feeds):
            batch = self.builder.build(ForwardMode.VERIFY, rows, prefix, [t for f in feeds for t in f], 2)
            return self.runner.forward(batch)[1:2 * len(rows):2]
        if all(len(f) == 1 for f in feeds) and self.builder.fits(len(rows), 1):
            return self.runner.forward(self.builder.build(ForwardMode.DECODE, rows, prefix, [f[0] for f in feeds]))
        return self.runner.forward(make_batch(self.pool, ForwardMode.PREFILL, rows, prefix, feeds))

    def _decode(self, states: list[_State], offset: int, tokens: torch.Tensor) -> torch.Tensor:
        """A DECODE step feeding ``tokens`` ([B] int64, on the device) at positions ``len(fed) + offset``."""
        rows = [st.row for st in states]
        batch = self.builder.build(ForwardMode.DECODE, rows, [len(st.fed) + offset for st in states],
                                   [0] * len(rows))
        batch.input_ids.copy_(tokens)  # after the builder's upload on the same stream: the graph reads these
        return self.runner.forward(batch)

    def _sample(self, q: torch.Tensor, states: list[_State]) -> torch.Tensor:
        """One draw per row of ``q`` ([B, V] probabilities) with each request's draft generator (Gumbel-max)."""
        picked = torch.argmax(q, dim=-1)
        for i, st in enumerate(states):
            if st.generator is not None:
                u = torch.rand(q.shape[1], generator=st.generator, device=q.device).clamp_(1e-20, 1.0 - 1e-7)
                picked[i] = torch.argmax(torch.log(q[i]) - torch.log(-torch.log(u)))
        return picked
