"""What flows between the HTTP side and the engine loop: a request, its deltas, and the stream that carries them.

``RequestStream`` is filled from the loop thread (``deliver``: one ``call_soon_threadsafe`` per event loop per
batch) and read by an asyncio task, which turns the deltas' token ids into text (``IncrementalDetokenizer``)
and applies stop strings; a hit ends the stream and asks the loop to abort the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lowlat.runtime.sampling import SamplingParams
from lowlat.serve.detokenizer import IncrementalDetokenizer


class StreamOwner(Protocol):
    """What a stream needs of the loop that feeds it (``EngineLoop``): aborting its request."""

    def abort(self, handle: int, finish: str = ...) -> object: ...


@dataclass
class GenRequest:
    """One generation as the HTTP side asks for it (already tokenized and validated)."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: Sequence[str] = ()
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None  # number of top alternatives per token; None: no logprobs
    timeout_s: float | None = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class Delta:
    """What one step added to a request: ids, logprobs, and (filled by ``RequestStream.get``) text.

    The last delta has ``finish_reason``: stop | length | abort | timeout | error | invalid (refused at add).
    ``stop_token``: the last id is a stop token id (it counts as generated but has no text).
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_token: bool = False


class RequestStream:
    """Deltas of one request, put by the loop thread, read (and detokenized) by an asyncio task on ``aloop``.

    Args:
        tokenizer: decodes the ids into ``Delta.text``; None leaves the text empty.
        stop: stop strings; the first hit ends the stream (``finish_reason="stop"``) and aborts the request.
    """

    def __init__(self, aloop: asyncio.AbstractEventLoop, tokenizer: Any = None, stop: Sequence[str] = ()) -> None:
        self._aloop = aloop
        self._q: asyncio.Queue[Delta] = asyncio.Queue()
        self.handle = -1
        self.owner: StreamOwner | None = None
        self.prompt_tokens = 0
        self.tokens = 0  # ids received so far
        self.ended = False
        self._detok = IncrementalDetokenizer(tokenizer, stop) if tokenizer is not None else None

    def put(self, d: Delta) -> None:
        """Put one delta (from any thread)."""
        deliver(self._aloop, [(self, d)])

    async def get(self, timeout_s: float) -> Delta:
        """The next delta, with its text. Raises asyncio.TimeoutError after ``timeout_s``."""
        d = await asyncio.wait_for(self._q.get(), timeout_s)
        return self.process(d)

    def process(self, d: Delta) -> Delta:
        """Fill ``d.text`` and apply stop strings (on the reading thread)."""
        self.tokens += len(d.token_ids)
        if self._detok is None or self.ended:
            return d
        ids = d.token_ids[:-1] if d.stop_token else d.token_ids
        if d.finish_reason in (None, "stop", "length"):
            d.text = self._detok.add(ids)
            if self._detok.stopped and d.finish_reason is None:  # a stop string: end here, abort the request
                d.finish_reason = "stop"
                d.prompt_tokens, d.completion_tokens = self.prompt_tokens, self.tokens
                if self.owner is not None:
                    self.owner.abort(self.handle, finish="stop")
            if d.finish_reason is not None:
                d.text += self._detok.finish()
        if d.finish_reason is not None:
            self.ended = True
        return d


def _put_all(items: list[tuple[RequestStream, Delta]]) -> None:
    for stream, d in items:
        stream._q.put_nowait(d)


def deliver(aloop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, Delta]]) -> None:
    """Hand ``items`` to their streams on ``aloop`` with one wake-up of that loop (thread-safe)."""
    try:
        aloop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the event loop is closed: nobody is reading any more
        pass
