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
from typing import Any

import torch

from lowlat.config import ConfigError, EngineConfig, SpeculativeMethod, parse_method
from lowlat.runtime.scheduler import Request

__all__ = ["Drafter", "Drafts", "SpeculativeMethod", "make_drafter", "parse_method", "request_seed"]


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


def make_drafter(config: EngineConfig, ctx: Any = None) -> Drafter:
    """The drafter ``config.speculative_method`` names.

    Args:
        config: the engine's configuration (speculative on).
        ctx: the engine's ``tp_launch.TPContext`` (None without tensor parallelism); a draft model shards with it.

    Raises:
        ConfigError: a bad method string, or a draft model whose vocabulary differs from the target's.
    """
    from lowlat.loader import resolve_model

    spec = parse_method(config.speculative_method or "ngram")
    vocab = resolve_model(config.model).vocab_size
    k = config.draft_tokens
    if spec.kind == "ngram":
        from lowlat.runtime.speculative.ngram import NgramDrafter

        return NgramDrafter(n=config.ngram_n, window=config.ngram_window, max_len=config.max_context_len)
    if spec.kind == "simulated":
        from lowlat.runtime.speculative.simulated import SimulatedDrafter

        return SimulatedDrafter(spec.mean, k=k, vocab_size=vocab, seed=config.seed)
    if spec.kind == "draft":
        from lowlat.runtime.speculative.draft_model import DraftModelDrafter

        draft_vocab = resolve_model(spec.path).vocab_size
        if draft_vocab != vocab:
            raise ConfigError(f"draft model {spec.path} has vocab_size={draft_vocab} but {config.model} has {vocab}; "
                              "a draft model needs the target's tokenizer (the same vocabulary)")
        return DraftModelDrafter(config, spec.path, ctx)
    raise ConfigError(f"unknown speculative method {spec.kind!r}")
