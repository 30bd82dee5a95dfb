"""The OpenAI wire format the server speaks: request bodies, their checks, and response bodies.

This module owns what a request may say (pydantic models of ``/v1/chat/completions`` and
``/v1/completions``, the parameters we support and the ones we refuse by name), the error shape
(``{"error": {"message", "type", "param", "code"}}``) and the response and chunk bodies. It knows
nothing of models, tokenizers or the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from epikv.serve.errors import ServeError

MAX_LOGPROBS = 20  # top_logprobs / logprobs a request may ask for (vLLM's default limit)


class _Common(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored (as OpenAI-compatible servers do);
    known ones we do not implement are refused by name in :meth:`refuse_unsupported`."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch.Generator takes
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # epikv extensions
    ignore_eos: bool = False
    kv_budget: int | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def refuse_unsupported(self) -> None:
        checks = [
            ("n", self.n != 1, "only n=1 is supported"),
            ("presence_penalty", self.presence_penalty != 0, "presence_penalty is not supported"),
            ("frequency_penalty", self.frequency_penalty != 0, "frequency_penalty is not supported"),
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
        ]
        for param, bad, message in checks:
            if bad:
                raise ServeError(message, param=param, code="unsupported_parameter")

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and not isinstance(value.get("include_usage", False), bool):
            raise ValueError("include_usage must be a boolean")
        return value

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ServeError(
                    f"content parts of type {part.get('type')!r} are not supported", param="messages"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ServeError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.tools:
            raise ServeError("tools are not supported", param="tools", code="unsupported_parameter")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ServeError("only text responses are supported", param="response_format")

    def conversation(self) -> list[dict[str, str]]:
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise ServeError("suffix is not supported", param="suffix", code="unsupported_parameter")
        if self.echo and self.stream:
            raise ServeError("echo is not supported with stream", param="echo", code="unsupported_parameter")
        if self.max_tokens == 0 and not self.echo:
            raise ServeError(
                "max_tokens 0 needs echo: true (the prompt's log-probabilities)", param="max_tokens"
            )
        if self.best_of not in (None, 1):
            raise ServeError("only best_of=1 is supported", param="best_of", code="unsupported_parameter")

    def prompt_text_or_ids(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise ServeError("one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ServeError("the prompt is empty", param="prompt")
        return prompt

    @property
    def requested_tokens(self) -> int | None:
        return self.max_tokens


def parse(model: type[ChatRequest] | type[CompletionRequest], body: Any) -> Any:
    """A validated request, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise ServeError("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ())) or None
        raise ServeError(
            f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param
        ) from err
    request.refuse_unsupported()
    return request


# -- responses --------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(
    prompt: int,
    completion: int,
    peak: int | None = None,
    evictions: int | None = None,
    budget: int | None = None,
) -> dict[str, Any]:
    """OpenAI's usage; with the cache's counters when known, and ``kv_budget``, the K the request ran
    at (raised for a prompt whose protected tokens pass it), when it evicts."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if peak is not None:
        out.update(peak_cache_tokens=peak, evictions=evictions)
    if budget is not None:
        out["kv_budget"] = budget
    return out


def chat_response(
    rid: str, model: str, text: str, finish: str, used: dict[str, Any], logprobs: Any = None
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
        "logprobs": logprobs,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": used,
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, Any] | None,
    finish: str | None = None,
    used: Any = None,
    logprobs: Any = None,
) -> dict[str, Any]:
    choices = (
        [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
    )
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if used is not None:
        chunk["usage"] = used
    return chunk


def completion_response(
    rid: str, model: str, text: str, finish: str | None, used: Any = None, logprobs: Any = None
) -> dict[str, Any]:
    """A whole ``text_completion`` (or one streamed chunk of it: ``finish`` None, ``used`` None)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}],
    }
    if used is not None:
        body["usage"] = used
    return body
