"""OpenAI request bodies as pydantic models, with the checks that turn bad values into 400s naming the field.

Fields follow the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``); ``top_k``,
``ignore_eos``, ``stop_token_ids`` and ``min_tokens``-style extras arrive through the client's ``extra_body``
as in vLLM. Fields the API has but lowlat does not implement are accepted only at their no-op value
(``n=1``, ``presence_penalty=0``, ...), otherwise rejected with a 400 that names them; unknown fields are
rejected too (``extra="forbid"``), so a typo never passes silently.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_LOGPROBS = 20


class InvalidParam(ValueError):
    """A request value lowlat cannot serve; ``param`` names the field (the 400's ``error.param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM: -1 or 0 disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    timeout: float | None = Field(default=None, gt=0.0)  # lowlat extra: seconds for this request
    return_token_ids: bool = False  # lowlat/vLLM extra: each choice also carries its "token_ids"

    @model_validator(mode="after")
    def _supported(self) -> _Sampling:
        if self.n != 1:
            raise InvalidParam("n", f"n={self.n} is not supported; lowlat returns one choice per request (n=1)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidParam(name, f"{name} is not supported; leave it at 0")
        if self.logit_bias:
            raise InvalidParam("logit_bias", "logit_bias is not supported")
        stops = self.stop_list
        if len(stops) > 16 or any(not s for s in stops):
            raise InvalidParam("stop", "stop takes at most 16 non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise InvalidParam("stream_options", "stream_options is only allowed with stream=true")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt (a string, token ids, or a list holding one of them)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidParam("prompt", f"prompt holds {len(p)} prompts; lowlat serves one prompt per request")
            self.prompt = p[0]
        if self.prompt in ("", []):
            raise InvalidParam("prompt", "prompt is empty")
        if self.echo:
            raise InvalidParam("echo", "echo is not supported")
        if self.best_of not in (None, 1):
            raise InvalidParam("best_of", "best_of is not supported (only 1)")
        if self.suffix:
            raise InvalidParam("suffix", "suffix is not supported")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template as they are
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text: a list of parts must be text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        out = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidParam("messages", f"content part of type {part.get('type')!r} is not supported "
                                               "(text only)")
            out.append(part["text"])
        return "".join(out)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        if self.tools:
            raise InvalidParam("tools", "tool calling is not supported")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise InvalidParam("response_format", "only response_format {\"type\": \"text\"} is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParam("top_logprobs", "top_logprobs needs logprobs=true")
        return self

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            d = m.model_dump(exclude_none=True)
            d["content"] = m.text()
            out.append(d)
        return out


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
