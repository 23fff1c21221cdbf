"""Response bodies and SSE chunks in OpenAI's shapes, built from the engine loop's deltas.

``/v1/completions`` answers ``text_completion`` objects (legacy logprobs: ``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``); ``/v1/chat/completions`` answers ``chat.completion`` /
``chat.completion.chunk`` objects (logprobs as ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from lowlat.serve.streams import Delta, TokenLogprob


class Formatter:
    """Builds one request's bodies. ``chat`` picks the chat shapes; ``tokenizer`` names tokens in logprobs."""

    def __init__(self, *, chat: bool, model: str, tokenizer: Any, token_ids: bool = False) -> None:
        self.chat = chat
        self.token_ids = token_ids
        self.model = model
        self.tokenizer = tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offset = 0  # text offset for completions logprobs

    def _token(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def logprobs(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        if self.chat:
            def entry(tid: int, lp: float) -> dict[str, Any]:
                text = self._token(tid)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                                for t in lps]}
        tokens = [self._token(t.token_id) for t in lps]
        offsets = []
        for tok in tokens:
            offsets.append(self._offset)
            self._offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
                "top_logprobs": [self._top_dict(t.top) for t in lps], "text_offset": offsets}

    def _top_dict(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """The legacy ``{token text: logprob}``; ids with the same text keep the likeliest one's value."""
        out: dict[str, float] = {}
        for i, v in top:
            out.setdefault(self._token(i), v)
        return out

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, d: Delta | None, *, first: bool = False, usage: bool = False) -> dict[str, Any]:
        """One SSE chunk: the role chunk (chat, ``first``), a delta, or the usage chunk (``d`` the last delta)."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        if usage:
            body["choices"] = []
            body["usage"] = self.usage(d.prompt_tokens, d.completion_tokens)
            return body
        if first:
            choice: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}
        elif self.chat:
            choice = {"index": 0, "delta": {"content": d.text} if d.text or not d.finish_reason else {},
                      "logprobs": self.logprobs(d.logprobs), "finish_reason": d.finish_reason}
        else:
            choice = {"index": 0, "text": d.text, "logprobs": self.logprobs(d.logprobs),
                      "finish_reason": d.finish_reason}
        if self.token_ids and not first:
            choice["token_ids"] = d.token_ids
        body["choices"] = [choice]
        return body

    def full(self, deltas: list[Delta]) -> dict[str, Any]:
        """The non-streaming body from all of a request's deltas (the last one finished it)."""
        last = deltas[-1]
        text = "".join(d.text for d in deltas)
        lps = None
        if any(d.logprobs is not None for d in deltas):
            lps = self.logprobs([t for d in deltas for t in (d.logprobs or [])])
        body = self._head("chat.completion" if self.chat else "text_completion")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                      "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": last.finish_reason}
        if self.token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        body["choices"] = [choice]
        body["usage"] = self.usage(last.prompt_tokens, last.completion_tokens)
        return body


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
