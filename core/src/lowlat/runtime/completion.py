"""What the Engine hands back: a finished request (``Completion``) and what one VERIFY step did (``VerifyResult``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Completion:
    """One finished request.

    Attributes:
        request_id: the engine's id for it.
        prompt_token_ids / token_ids: prompt and generated ids (an EOS that ended it is included).
        text: ``token_ids`` decoded, special tokens skipped.
        finish_reason: "eos" or "length".
        queue_s: seconds from being added to its first prefill step.
        prefill_s: seconds from its first prefill step to its first token.
        decode_s: seconds from its first token to its last; ``decode_tokens`` tokens came in that time.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    queue_s: float
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after the first one (by DECODE/VERIFY steps)."""
        return max(len(self.token_ids) - 1, 0)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode throughput of this request (0.0 when it produced one token only)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class VerifyResult:
    """What one VERIFY step did: tokens appended per request id, and the requests it finished."""

    accepted: dict[int, list[int]]
    finished: list[Completion]


def completion_of(r: Any, decode: Callable[[list[int]], str]) -> Completion:
    """The Completion of finished request ``r`` (a scheduler ``Request``); ``decode`` is the tokenizer's."""
    first = r.t_first_token or r.t_finish
    return Completion(
        request_id=r.rid, prompt_token_ids=r.prompt_ids, token_ids=list(r.output_ids),
        text=decode(r.output_ids), finish_reason=r.finish_reason or "length",
        queue_s=(r.t_prefill_start or r.t_added) - r.t_added, prefill_s=first - (r.t_prefill_start or first),
        decode_s=r.t_finish - first,
    )
