"""The drafter interface and the registry that builds one from ``EngineConfig.speculative_method``.

A drafter proposes up to k draft tokens for each decoding request; the engine's speculative step
(``lowlat.runtime.speculative.speculator``) pads them to one k for the batch, scores them in one VERIFY step and
appends what ``lowlat.runtime.speculative.verify`` accepts. A drafter keeps its own state per request id (an
n-gram index, a draft model's KV row, ...), reads each request's tokens itself (``prompt_ids + output_ids``: what
the verifier appended since the last call, however many steps ago, is there) and frees the state in ``release``.

Every rank of a tensor-parallel group runs the same drafter on the same tokens, so a drafter must be
deterministic given the requests (seeded randomness only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowlat.config import SpeculativeMethod, parse_method
from lowlat.runtime.scheduler import Request

__all__ = ["Drafter", "Drafts", "SpeculativeMethod", "parse_method", "request_seed"]


@dataclass
class Drafts:
    """What ``Drafter.propose`` returns for B requests.

    Attributes:
        tokens: B lists of draft ids, each of at most k tokens (shorter or empty: nothing to propose).
        probs: [B, k, V] float32 draft distributions the tokens were drawn from (rows of a greedy request, and
            rows past a request's drafts, are one-hot), or None when every draft is a point mass (deterministic
            drafters). Used by rejection sampling; on the drafter's device.
        warm: False when proposing cost more than its steady state (a draft model catching up on a prompt or
            on the tokens of steps it sat out): the step's time is then not a measurement of speculation.
    """

    tokens: list[list[int]]
    probs: torch.Tensor | None = None
    warm: bool = True


class Drafter:
    """Proposes draft tokens. Subclasses implement ``propose`` and, if they keep state, ``release``.

    Attributes:
        name: shown in stats ("ngram", "draft:PATH", "simulated:MEAN").
        simulated: the verifier must use ``accept_counts`` instead of the model's scores (benchmarks only).
    """

    name = "drafter"
    simulated = False

    def propose(self, requests: Sequence[Request], k: int) -> Drafts:
        """Up to ``k`` draft ids for each of ``requests`` (DECODING; ``output_ids[-1]`` is the pending token)."""
        raise NotImplementedError

    def release(self, rid: int) -> None:
        """Forget request ``rid`` (it finished or was aborted). Unknown ids are ignored."""

    def close(self) -> None:
        """Free what the drafter holds (a draft model, its KV pool)."""


def request_seed(req: Request, engine_seed: int) -> int:
    """The seed the engine gives request ``req``'s generator (``Engine._add_ids``'s rule)."""
    return req.params.seed if req.params.seed is not None else engine_seed * 1_000_003 + req.rid
