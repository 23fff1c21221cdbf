"""The load generator of ``lowlat bench serve``: concurrent streaming clients against one server.

Each client sends ``/v1/completions`` requests with a prompt of exactly ``input_len`` random token ids,
``max_tokens=output_len``, ``ignore_eos`` (so every request yields ``output_len`` tokens) and
``return_token_ids`` (so each SSE chunk says how many tokens it carries), and records when the request was
sent and when each chunk arrived. The streams are read with httpx and ``json.loads``, which costs the
measuring process less per chunk than the openai client's pydantic models (it shares the host with the
server). ``run_level`` keeps ``concurrency`` requests in flight until ``num_requests`` are done.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

REQUEST_TIMEOUT_S = 1800.0


@dataclass
class RequestRecord:
    """One measured request: times in seconds since its send (``perf_counter``), tokens per chunk."""

    t_send: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    t_end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return next(t for t, n in zip(self.chunk_times, self.chunk_tokens) if n) - self.t_send

    @property
    def e2e(self) -> float:
        return self.t_end - self.t_send

    @property
    def tpot(self) -> float | None:
        """Mean seconds per token after the first (None for a one-token request)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itl(self) -> list[float]:
        """Gaps between successive token-carrying chunks."""
        times = [t for t, n in zip(self.chunk_times, self.chunk_tokens) if n]
        return [b - a for a, b in zip(times, times[1:])]


def random_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``input_len`` token ids drawn uniformly from [1, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(input_len)] for _ in range(n)]


async def one_request(client: object, url: str, model: str, prompt: list[int], output_len: int) -> RequestRecord:
    """Send one streaming completion and time its chunks; an HTTP or stream error lands in ``error``."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}
    rec = RequestRecord(time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if line == "data: [DONE]":
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    rec.error = obj["error"].get("message", "error")
                    break
                if obj.get("usage"):
                    rec.prompt_tokens = obj["usage"]["prompt_tokens"]
                    rec.output_tokens = obj["usage"]["completion_tokens"]
                for ch in obj.get("choices") or ():
                    rec.chunk_times.append(now)  # a server without return_token_ids: one token per text chunk
                    ids = ch.get("token_ids")
                    rec.chunk_tokens.append(len(ids) if ids is not None else int(bool(ch.get("text"))))
    except Exception as e:  # connection refused, reset, timeout: the record says why
        rec.error = f"{type(e).__name__}: {e}"
    rec.t_end = time.perf_counter()
    if rec.error is None and not rec.output_tokens:
        rec.output_tokens = sum(rec.chunk_tokens)
    if rec.error is None and not any(rec.chunk_tokens):
        rec.error = "the stream carried no tokens"
    return rec


async def run_level(url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
                    on_done: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Run every prompt with ``concurrency`` in flight. Returns (records in completion order, wall seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    todo: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        todo.put_nowait(p)
    records: list[RequestRecord] = []

    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0), limits=limits) as client:
        async def worker() -> None:
            while True:
                try:
                    p = todo.get_nowait()
                except asyncio.QueueEmpty:
                    return
                rec = await one_request(client, url, model, p, output_len)
                records.append(rec)
                if on_done is not None:
                    on_done(rec)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return records, wall
