"""The FastAPI app: OpenAI-compatible routes over an ``EngineLoop``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming over SSE with ``stream: true``),
``GET /v1/models`` (its entry's ``serving_path``: which path serves, ``EngineLoop.serving_path``), ``GET /health``,
``GET /metrics``. The routes validate and tokenize, put a ``GenRequest`` on the engine loop and read deltas from
its stream; they never call the Engine. Errors use OpenAI's shape
(``schemas.error_body``): 400 for bad parameters (``param`` names the field), 404 for an unknown model or
route, 503 with ``Retry-After`` when the queue is full or the server is shutting down, 504 when a request
passes its timeout, 500 when the engine failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lowlat.runtime.sampling import SamplingParams
from lowlat.serve.chat_template import ChatTemplate, ChatTemplateError
from lowlat.serve.engine_loop import EngineLoop, NotAccepting, Overloaded
from lowlat.serve.metrics import CONTENT_TYPE, ServeMetrics
from lowlat.serve.openai_format import SSE_DONE, Formatter, sse
from lowlat.serve.schemas import ChatCompletionRequest, CompletionRequest, InvalidParam, error_body
from lowlat.serve.streams import Delta, GenRequest, RequestStream

DISCONNECT_POLL_S = 0.5
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), type_=self.type, param=self.param, code=self.code),
                            status_code=self.status, headers=self.headers)


@dataclass
class ServeSettings:
    """What the app needs besides the loop. ``request_timeout_s``: the default and the largest per request."""

    model_name: str
    chat_template: ChatTemplate
    request_timeout_s: float = 600.0
    retry_after_s: int = 1


def create_app(loop: EngineLoop, settings: ServeSettings, metrics: ServeMetrics | None = None) -> FastAPI:
    """The app serving ``loop`` (started and stopped by the caller)."""
    app = FastAPI(title="lowlat", docs_url=None, redoc_url=None)
    app.state.loop, app.state.settings, app.state.metrics = loop, settings, metrics
    if metrics is not None:
        metrics.bind(lambda: loop.pending, lambda: loop.in_flight)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        if metrics is not None and exc.status in (400, 404, 503):
            metrics.rejected.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        if metrics is not None:
            metrics.rejected.labels("400").inc()
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), type_="not_found_error" if exc.status_code == 404
                        else "invalid_request_error").response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if loop.healthy else 503)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        if metrics is None:
            raise APIError(404, "metrics are off")
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "lowlat", "max_model_len": loop.max_context_len,
                                            "serving_path": loop.serving_path}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body.model, settings)
        if isinstance(body.prompt, str):
            ids = loop.tokenizer.encode(body.prompt)
        else:
            ids = list(body.prompt)
            bad = [t for t in ids if not 0 <= t < loop.vocab_size]
            if bad:
                raise APIError(400, f"prompt has token id {bad[0]} outside the vocabulary [0, {loop.vocab_size})",
                               param="prompt")
        gen = _gen_request(body, ids, body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs, loop,
                           settings, "prompt")
        return await _respond(request, loop, gen, body, Formatter(chat=False, model=body.model,
                                                                  tokenizer=loop.tokenizer,
                                                                  token_ids=body.return_token_ids))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(body.model, settings)
        extra = dict(body.chat_template_kwargs or {})
        reserved = sorted(set(extra) & {"messages", "add_generation_prompt", *settings.chat_template.special_tokens})
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}",
                           param="chat_template_kwargs")
        try:
            text = settings.chat_template.render(body.template_messages(),
                                                 add_generation_prompt=body.add_generation_prompt, **extra)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        except InvalidParam as e:
            raise APIError(400, str(e), param=e.param) from None
        ids = loop.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise APIError(400, "the chat template rendered the messages to no tokens", param="messages")
        budget = body.token_budget or max(1, request_limit(loop) - len(ids))  # OpenAI: up to the context
        top = (body.top_logprobs or 0) if body.logprobs else None
        gen = _gen_request(body, ids, budget, top, loop, settings, "messages")
        return await _respond(request, loop, gen, body, Formatter(chat=True, model=body.model,
                                                                  tokenizer=loop.tokenizer,
                                                                  token_ids=body.return_token_ids))

    return app


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field."""
    errs = exc.errors()
    first = errs[0] if errs else {}
    ctx_err = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_err, InvalidParam):
        return APIError(400, str(ctx_err), param=ctx_err.param)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        msg = f"unknown field {param!r}; lowlat does not support it"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def _check_model(model: str, settings: ServeSettings) -> None:
    if model != settings.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {settings.model_name!r}",
                       type_="not_found_error", param="model", code="model_not_found")


def request_limit(loop: EngineLoop) -> int:
    """Tokens one request may hold here, prompt plus completion (the context, or the KV pool if smaller)."""
    return min(loop.max_context_len, loop.max_cached_tokens + 1)


def _gen_request(body: Any, ids: list[int], max_tokens: int, logprobs: int | None, loop: EngineLoop,
                 settings: ServeSettings, prompt_field: str) -> GenRequest:
    """Validate lengths and sampling values against this engine; raises APIError(400) naming the field."""
    limit = request_limit(loop)
    if len(ids) >= limit:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most {limit - 1} "
                            f"(max_context_len {loop.max_context_len})", param=prompt_field)
    if len(ids) + max_tokens > limit:
        raise APIError(400, f"max_tokens={max_tokens} with a prompt of {len(ids)} tokens exceeds the {limit} tokens "
                            f"a request may hold here; lower max_tokens to at most {limit - len(ids)}",
                       param="max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens")
    bad = [t for t in body.stop_token_ids if not 0 <= t < loop.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids has {bad[0]}, outside the vocabulary", param="stop_token_ids")
    timeout = min(body.timeout or settings.request_timeout_s, settings.request_timeout_s)
    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                top_k=max(body.top_k, 0), seed=body.seed, stop_at_eos=not body.ignore_eos)
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
    return GenRequest(ids, params, stop=body.stop_list, stop_token_ids=frozenset(body.stop_token_ids),
                      logprobs=logprobs, timeout_s=timeout)


def _submit(loop: EngineLoop, gen: GenRequest, settings: ServeSettings) -> RequestStream:
    stream = RequestStream(asyncio.get_running_loop(), loop.tokenizer, gen.stop)
    try:
        loop.submit(gen, stream)
    except Overloaded as e:
        raise APIError(503, f"the server is overloaded: {e}; retry later", type_="server_error", code="overloaded",
                       headers={"Retry-After": str(settings.retry_after_s)}) from None
    except NotAccepting as e:
        raise APIError(503, str(e), type_="server_error", code="unavailable",
                       headers={"Retry-After": str(settings.retry_after_s)}) from None
    return stream


def _delta_error(d: Delta) -> APIError | None:
    """The APIError a request's last delta stands for, if it did not end normally."""
    if d.finish_reason in ("stop", "length"):
        return None
    if d.finish_reason == "invalid":
        return APIError(400, d.error or "invalid request", param="prompt")
    if d.finish_reason == "timeout":
        return APIError(504, d.error or "timed out", type_="timeout_error", code="timeout")
    if d.finish_reason == "abort":
        return APIError(503, d.error or "aborted", type_="server_error", code="unavailable")
    return APIError(500, d.error or "engine failure", type_="server_error", code="engine_error")


async def _respond(request: Request, loop: EngineLoop, gen: GenRequest, body: Any, fmt: Formatter) -> Response:
    settings: ServeSettings = request.app.state.settings
    stream = _submit(loop, gen, settings)
    deadline = time.monotonic() + gen.timeout_s + 5.0  # the loop times the request out first
    if body.stream:
        return StreamingResponse(_sse(loop, stream, fmt, body.include_usage, deadline),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    deltas: list[Delta] = []
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while not deltas or deltas[-1].finish_reason is None:
            try:
                deltas.append(await stream.get(DISCONNECT_POLL_S))
            except asyncio.TimeoutError:
                pass
            now = time.monotonic()
            if now >= next_check:  # by the clock: deltas may come every step and never let get() time out
                next_check = now + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    loop.abort(stream.handle)
                    return Response(status_code=499)
            if now > deadline:
                raise APIError(504, "the engine did not answer in time", type_="timeout_error")
    except BaseException:
        if not deltas or deltas[-1].finish_reason is None:
            loop.abort(stream.handle)
        raise
    err = _delta_error(deltas[-1])
    if err is not None:
        raise err
    return JSONResponse(fmt.full(deltas))


async def _sse(loop: EngineLoop, stream: RequestStream, fmt: Formatter, include_usage: bool,
               deadline: float) -> AsyncIterator[str]:
    """The SSE body; a client that goes away cancels this generator, which aborts the request."""
    done = False
    try:
        if fmt.chat:
            yield sse(fmt.chunk(None, first=True))
        while True:
            try:
                d = await stream.get(max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                yield sse(error_body("the engine did not answer in time", type_="timeout_error"))
                break
            err = _delta_error(d) if d.finish_reason else None
            if err is not None:
                done = True
                yield sse(error_body(str(err), type_=err.type, param=err.param, code=err.code or err.status))
                break
            yield sse(fmt.chunk(d))  # every step's delta, "" text included: clients can time each token
            if d.finish_reason:
                done = True
                if include_usage:
                    yield sse(fmt.chunk(d, usage=True))
                break
        yield SSE_DONE
    finally:
        if not done:
            loop.abort(stream.handle)
