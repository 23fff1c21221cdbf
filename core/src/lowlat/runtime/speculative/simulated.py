"""Simulated acceptance, for benchmarks only: the cost of speculation on random-weight presets.

BENCHMARK ONLY: the text is not the model's. The drafter proposes random ids and the verifier ignores the
scores: each request keeps ``n`` of its k drafts with the i.i.d. acceptance model of Leviathan et al. 2023
(§3.1: each draft kept with probability ``alpha`` while the ones before it were), so
``E[n + 1] = 1 + alpha + ... + alpha^k``; ``alpha`` is solved so that this mean acceptance length equals the
configured MEAN at k drafts. The token after the kept drafts is the model's own pick at that row. Only the cost
(drafting nothing, VERIFY steps of k + 1 rows, appends and KV rollback) is real; every output says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowlat.runtime.scheduler import Request
from lowlat.runtime.speculative.drafter import Drafter, Drafts

LABEL = "SIMULATED acceptance (benchmark only: the text is not the model's)"


def acceptance_rate(mean: float, k: int) -> float:
    """``alpha`` in [0, 1] with ``1 + alpha + ... + alpha^k == mean`` (bisection; mean in [1, k + 1])."""
    if not 1.0 <= mean <= k + 1:
        raise ValueError(f"a mean acceptance length with k={k} drafts lies in [1, {k + 1}], got {mean}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(k + 1)) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class SimulatedDrafter(Drafter):
    """Random drafts plus ``accept_counts`` (see the module docstring).

    Args:
        mean: the mean acceptance length at ``k`` drafts (tokens per request per VERIFY step, bonus included).
        k: draft tokens per step the mean refers to (EngineConfig.draft_tokens).
        vocab_size: drafts are drawn from [0, vocab_size).
        seed: seeds the one CPU generator (the same on every TP rank).
    """

    simulated = True

    def __init__(self, mean: float, *, k: int, vocab_size: int, seed: int = 0) -> None:
        self.mean = mean
        self.alpha = acceptance_rate(mean, k)
        self.vocab_size = vocab_size
        self.name = f"simulated:{mean:g}"
        self._gen = torch.Generator().manual_seed(0x5EED ^ int(seed))

    def propose(self, requests: Sequence[Request], k: int) -> Drafts:
        ids = torch.randint(0, self.vocab_size, (len(requests), k), generator=self._gen)
        return Drafts(ids.tolist())

    def accept_counts(self, batch_size: int, k: int) -> list[int]:
        """Drafts kept per request: leading successes of Bernoulli(alpha) trials, at most ``k``."""
        ok = torch.rand(batch_size, k, generator=self._gen) < self.alpha
        return torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1).tolist()
