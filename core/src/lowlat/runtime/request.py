"""A request's life in the engine (``Request``, ``RequestState``) and one scheduled step (``ScheduledStep``).

The Scheduler (``lowlat.runtime.scheduler``) makes and updates them; the Engine reads them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.runtime.sampling import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"  # not admitted: no request row, no KV
    PREFILLING = "prefilling"  # admitted, part of the prompt is in the KV cache
    DECODING = "decoding"  # prompt done; output_ids[-1] is the next input
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request.

    Attributes:
        rid: request id (engine-wide counter; the same on every TP rank).
        prompt_ids: prompt token ids.
        params: its sampling parameters.
        generator: its seeded generator (None when greedy).
        seed: the generator's seed (a sampling plugin's ``SamplingInfo.seeds``; 0 when greedy).
        eos_ids: token ids that end it when ``params.stop_at_eos``.
        output_ids: generated ids so far.
        row: its ``req_to_token`` row while admitted.
        num_computed: tokens whose K/V are in the cache.
        finish_reason: "eos", "length" or "abort" once finished.
        t_*: ``time.perf_counter`` stamps (seconds): added, first prefill step began, first token, finished.
    """

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    eos_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    row: int | None = None
    num_computed: int = 0
    finish_reason: str | None = None
    t_added: float = 0.0
    t_prefill_start: float | None = None
    t_first_token: float | None = None
    t_finish: float | None = None
    seed: int = 0

    @property
    def max_cached_tokens(self) -> int:
        """Most tokens it ever holds in the KV cache: the last generated token is never fed back."""
        return len(self.prompt_ids) + self.params.max_new_tokens - 1

    @property
    def prompt_left(self) -> int:
        return len(self.prompt_ids) - self.num_computed


@dataclass
class ScheduledStep:
    """One step the scheduler decided on.

    Attributes:
        mode: PREFILL, DECODE or VERIFY.
        requests: the B requests in the step, in batch order.
        batch: the ForwardBatch (KV slots already allocated).
        sample_rows: logits rows to sample, and ``sample_reqs`` the request each belongs to. PREFILL samples
            the last-token row of each request whose prompt completes; DECODE and VERIFY sample every row.
        drafts: VERIFY only: request id -> its k draft tokens.
        greedy: every sampled request is greedy (the engine then takes an argmax per row, nothing else).
    """

    mode: ForwardMode
    requests: list[Request]
    batch: ForwardBatch
    sample_rows: list[int]
    sample_reqs: list[Request]
    drafts: dict[int, list[int]] | None = None
    greedy: bool = False


def accepted_tokens(step: ScheduledStep, picks: list[int]) -> dict[int, list[int]]:
    """Tokens a step appends per request id, from the token picked for each of its sample rows.

    PREFILL/DECODE: each sampled request's pick. VERIFY: a request's draft tokens while they equal its own picks,
    then its first differing pick (1..k+1 tokens).
    """
    if step.mode is not ForwardMode.VERIFY:
        return {r.rid: [t] for r, t in zip(step.sample_reqs, picks)}
    out: dict[int, list[int]] = {}
    k1 = step.batch.tokens_per_req
    for i, r in enumerate(step.requests):
        mine, draft = picks[i * k1:(i + 1) * k1], step.drafts[r.rid]
        n = 0
        while n < len(draft) and draft[n] == mine[n]:
            n += 1
        out[r.rid] = mine[:n + 1]
    return out
