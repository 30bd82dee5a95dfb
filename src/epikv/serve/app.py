"""The HTTP layer: OpenAI routes on FastAPI, turning requests into engine requests and engine text
into OpenAI bodies and server-sent-event chunks. It owns nothing else: admission, batching and
memory are the engine's (through :class:`~epikv.serve.worker.EngineWorker`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from epikv.engine import AdmissionError, SamplingParams
from epikv.engine import Request as EngineRequest
from epikv.serve import protocol as p
from epikv.serve.errors import ServeError
from epikv.serve.gate import Access, AccessRecord, Gate, record_of
from epikv.serve.limits import ServeLimits, read_json
from epikv.serve.logprobs import LogprobRecorder, TokenText, chat_logprobs, completion_logprobs
from epikv.serve.text import TextStream
from epikv.serve.worker import EngineWorker, Job, Outcome

GREEDY_BELOW = 1e-5  # a temperature under this is greedy (as vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class ServeSettings:
    """model_name: the id clients use; max_tokens: the largest max_tokens a request may ask for (also
    the default); eos: token ids that end a request unless it sets ``ignore_eos``; vocab_size: token
    ids a prompt may hold (None = unchecked); limits and access: see :class:`ServeLimits`, :class:`Access`."""

    model_name: str
    max_tokens: int
    eos: frozenset[int]
    vocab_size: int | None = None
    limits: ServeLimits = field(default_factory=ServeLimits)
    access: Access = field(default_factory=Access)


def create_app(worker: EngineWorker, tokenizer: Any, settings: ServeSettings) -> FastAPI:
    """The ASGI app; it starts the worker's thread at startup and stops it at shutdown."""

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="epikv", lifespan=lifespan)
    app.state.worker = worker
    app.add_middleware(Gate, access=settings.access, max_body_bytes=settings.limits.max_body_bytes)
    routes = _Routes(worker, tokenizer, settings)

    @app.exception_handler(ServeError)
    async def serve_error(http: Request, err: ServeError) -> JSONResponse:
        record = record_of(http.state)
        if record is not None:
            record.outcome = err.code or err.type
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(
            ServeError(str(err.detail), status=err.status_code).body(), status_code=err.status_code
        )

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        error = ServeError(f"internal error: {type(err).__name__}", status=500, code="internal_error")
        return JSONResponse(error.body(), status_code=500)

    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/completions")(routes.completions)
    app.get("/v1/models")(routes.models)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.metrics)
    return app


class _Routes:
    def __init__(self, worker: EngineWorker, tokenizer: Any, settings: ServeSettings) -> None:
        self.worker, self.tokenizer, self.settings = worker, tokenizer, settings
        self.limits = settings.limits
        self.token_text = TokenText(tokenizer)

    async def models(self) -> dict[str, Any]:
        model = {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "epikv"}
        return {"object": "list", "data": [model]}

    async def health(self) -> JSONResponse:
        ok = self.worker.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        return Response(self.worker.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def chat(self, http: Request) -> Any:
        request: p.ChatRequest = p.parse(p.ChatRequest, await read_json(http, self.limits))
        self._check_model(request.model)
        ids = self._chat_ids(request)
        top = (request.top_logprobs or 0) if request.logprobs else None
        job = await self._submit(request, ids, "messages", top)
        rid = p.new_id("chatcmpl")
        if request.stream:
            return _sse(self._chat_stream(job, request, rid, record_of(http.state)))
        outcome = await self._wait(http, job)
        logprobs = chat_logprobs(outcome.logprobs, self.token_text) if top is not None else None
        used = _usage(outcome, record_of(http.state))
        return p.chat_response(rid, request.model, outcome.text, outcome.finish_reason, used, logprobs)

    async def completions(self, http: Request) -> Any:
        request: p.CompletionRequest = p.parse(p.CompletionRequest, await read_json(http, self.limits))
        self._check_model(request.model)
        prompt = request.prompt_text_or_ids()
        ids = self._check_ids(prompt) if isinstance(prompt, list) else self._encode(prompt, "prompt")
        top = request.logprobs
        job = await self._submit(
            request, ids, "prompt", top, prompt_logprobs=request.echo and top is not None
        )
        rid = p.new_id("cmpl")
        if request.stream:
            return _sse(self._completion_stream(job, request, rid, record_of(http.state)))
        outcome = await self._wait(http, job)
        text, records = outcome.text, list(outcome.logprobs)
        if request.max_tokens == 0:  # only the prompt: the token the prefill picked is dropped
            text, records = "", []
            outcome.completion.token_ids = []
        if request.echo:
            text = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) + text
        logprobs = None
        if job.recorder is not None:
            records = [*job.recorder.prompt, *records] if request.echo else records
            logprobs = completion_logprobs(records, self.token_text, 0, ids)
        used = _usage(outcome, record_of(http.state))
        return p.completion_response(rid, request.model, text, outcome.finish_reason, used, logprobs)

    # -- the pieces ---------------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            message = f"The model `{model}` does not exist (this server serves `{self.settings.model_name}`)"
            raise ServeError(message, status=404, param="model", code="model_not_found")

    def _chat_ids(self, request: p.ChatRequest) -> list[int]:
        try:  # a chat template is code from the model's files: any failure there is the input's
            text = self.tokenizer.apply_chat_template(
                request.conversation(), add_generation_prompt=True, tokenize=False
            )
        except ServeError:
            raise
        except Exception as err:
            raise ServeError(f"the chat template refused the messages: {err}", param="messages") from None
        return self._encode(text, "messages", add_special_tokens=False)

    def _encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except Exception as err:
            raise ServeError(f"the text could not be tokenized: {err}", param=param) from None

    def _check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.settings.vocab_size
        if vocab is not None and any(not 0 <= i < vocab for i in ids):
            raise ServeError(f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        return list(ids)

    async def _submit(
        self, request: Any, ids: list[int], prompt_param: str, top: int | None, prompt_logprobs: bool = False
    ) -> Job:
        """Check the request against the limits and the engine (400 naming the parameter) and queue
        it (429 with Retry-After when full). ``top``: log-probabilities asked for (None: none), of
        the prompt's tokens too with ``prompt_logprobs``."""
        if not ids:
            raise ServeError("the prompt encodes to no tokens", param=prompt_param)
        longest = self.limits.max_prompt_tokens
        if longest is not None and len(ids) > longest:
            message = f"the prompt has {len(ids)} tokens; the server takes {longest} (--max-prompt-tokens)"
            raise ServeError(message, param=prompt_param, code="prompt_too_long")
        limit = self.settings.max_tokens
        max_tokens = request.requested_tokens if request.requested_tokens is not None else limit
        lowest = 0 if getattr(request, "echo", False) else 1  # 0: only the echoed prompt
        if not lowest <= max_tokens <= limit:
            raise ServeError(f"max_tokens must be in {lowest}..{limit}, got {max_tokens}", param="max_tokens")
        temperature = 1.0 if request.temperature is None else request.temperature
        if temperature < GREEDY_BELOW:  # logits / 1e-300 overflow to inf and NaN probabilities
            temperature = 0.0
        seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(4), "little")
        sampling = SamplingParams(temperature, 1.0 if request.top_p is None else request.top_p, seed)
        stops = frozenset() if request.ignore_eos else self.settings.eos
        # max_tokens 0 (an echoed prompt's log-probabilities): the engine still picks one token
        engine_request = EngineRequest(ids, max(1, max_tokens), sampling, stops, budget=request.kv_budget)
        try:  # the engine's gate: kv_budget in 1..K, the prompt within context and budget, the pool
            self.worker.check(engine_request)
        except AdmissionError as err:
            param = {"budget": "kv_budget", "max_new_tokens": "max_tokens"}.get(err.field, prompt_param)
            message = f"kv_budget: {err}" if param == "kv_budget" else str(err)
            raise ServeError(message, param=param) from None
        recorder = None
        if top is not None:
            recorder = LogprobRecorder(top, ids if prompt_logprobs else None)
            engine_request.on_logits = recorder.on_logits
            if prompt_logprobs:
                engine_request.on_prompt_logits = recorder.on_prompt_logits
        text = TextStream(self.tokenizer, ids, request.stop)
        loop = asyncio.get_running_loop()
        job = Job(engine_request, text, asyncio.Queue(), loop, recorder, self.limits.request_timeout_s)
        engine_request.on_token = lambda token: self.worker.on_token(job, token)
        try:
            await asyncio.wrap_future(self.worker.submit(job))
        except ServeError as err:
            if err.status == 429:
                err.headers = {"Retry-After": str(self.limits.retry_after_s)}
            raise
        return job

    async def _wait(self, http: Request, job: Job) -> Outcome:
        """The outcome of a non-streamed request; a client that leaves cancels it."""
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    self.worker.cancel(job.request.id)
                    raise ServeError("client disconnected", status=499, code="left") from None
                continue
            if kind == "done":
                return value
            if kind == "error":
                raise value

    async def _events(self, job: Job, record: AccessRecord | None) -> AsyncIterator[tuple[str, Any]]:
        """A job's events until it is done; cancels it if the stream is closed early."""
        finished = False
        try:
            while True:
                kind, value = await job.events.get()
                finished = kind in ("done", "error")
                if record is not None and kind == "error":
                    record.outcome = value.code
                yield kind, value
                if finished:
                    return
        finally:
            if not finished:
                self.worker.cancel(job.request.id)
                if record is not None:
                    record.outcome = "left"

    async def _chat_stream(
        self, job: Job, request: p.ChatRequest, rid: str, record: AccessRecord | None
    ) -> AsyncIterator[str]:
        model, logprobs = request.model, request.logprobs

        def chunk(text: str, records: list) -> str:
            lp = chat_logprobs(records, self.token_text) if logprobs else None
            return _data(p.chat_chunk(rid, model, {"content": text}, logprobs=lp))

        yield _data(p.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        async for kind, value in self._events(job, record):
            if kind == "text":
                yield chunk(*value)
            elif kind == "done":
                rest = job.text.delta(final=True)
                if rest or value.rest:
                    yield chunk(rest, value.rest)
                yield _data(p.chat_chunk(rid, model, {}, value.finish_reason))
                used = _usage(value, record)
                if request.include_usage:
                    yield _data(p.chat_chunk(rid, model, None, used=used))
            else:
                yield _data(value.body())
        yield "data: [DONE]\n\n"

    async def _completion_stream(
        self, job: Job, request: p.CompletionRequest, rid: str, record: AccessRecord | None
    ) -> AsyncIterator[str]:
        model, logprobs = request.model, request.logprobs is not None

        def chunk(text: str, records: list, finish: str | None = None) -> str:
            lp = completion_logprobs(records, self.token_text) if logprobs else None
            return _data(p.completion_response(rid, model, text, finish, None, lp))

        async for kind, value in self._events(job, record):
            if kind == "text":
                yield chunk(*value)
            elif kind == "done":
                yield chunk(job.text.delta(final=True), value.rest, value.finish_reason)
                used = _usage(value, record)
                if request.include_usage:
                    body = p.completion_response(rid, model, "", None, used=used)
                    body["choices"] = []
                    yield _data(body)
            else:
                yield _data(value.body())
        yield "data: [DONE]\n\n"


def _usage(outcome: Outcome, record: AccessRecord | None) -> dict[str, Any]:
    """The response's usage; the access log gets it and the finish reason too."""
    c = outcome.completion
    used = p.usage(c.prompt_tokens, len(c.token_ids), c.peak_cache_tokens, c.evictions, c.budget)
    if record is not None:
        record.usage, record.outcome = used, outcome.finish_reason
    return used


def _data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _sse(stream: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
