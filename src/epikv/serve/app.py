"""The HTTP layer: OpenAI routes on FastAPI, turning requests into engine requests and engine text
into OpenAI bodies and server-sent-event chunks. It owns nothing else: admission, batching and
memory are the engine's (through :class:`~epikv.serve.worker.EngineWorker`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from epikv.engine import Request as EngineRequest
from epikv.engine import SamplingParams
from epikv.serve import protocol as p
from epikv.serve.protocol import ServeError
from epikv.serve.text import TextStream
from epikv.serve.worker import EngineWorker, Job, Outcome


@dataclass(frozen=True)
class ServeSettings:
    """model_name: the id clients use; max_tokens: the largest max_tokens a request may ask for (also
    the default); eos: token ids that end a request unless it sets ``ignore_eos``."""

    model_name: str
    max_tokens: int
    eos: frozenset[int]


def create_app(worker: EngineWorker, tokenizer: Any, settings: ServeSettings) -> FastAPI:
    """The ASGI app; it starts the worker's thread at startup and stops it at shutdown."""

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="epikv", lifespan=lifespan)
    app.state.worker = worker
    routes = _Routes(worker, tokenizer, settings)

    @app.exception_handler(ServeError)
    async def serve_error(_: Request, err: ServeError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

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

    async def models(self) -> dict[str, Any]:
        model = {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "epikv"}
        return {"object": "list", "data": [model]}

    async def health(self) -> JSONResponse:
        ok = self.worker.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        return Response(self.worker.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def chat(self, http: Request) -> Any:
        request: p.ChatRequest = p.parse(p.ChatRequest, await _json(http))
        self._check_model(request.model)
        text = self.tokenizer.apply_chat_template(
            request.conversation(), add_generation_prompt=True, tokenize=False
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        job = await self._submit(request, ids, "messages")
        rid = p.new_id("chatcmpl")
        if request.stream:
            return _sse(self._chat_stream(job, request, rid))
        outcome = await self._wait(http, job)
        return p.chat_response(rid, request.model, outcome.text, outcome.finish_reason, _usage(outcome))

    async def completions(self, http: Request) -> Any:
        request: p.CompletionRequest = p.parse(p.CompletionRequest, await _json(http))
        self._check_model(request.model)
        prompt = request.prompt_text_or_ids()
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
        job = await self._submit(request, ids, "prompt")
        rid = p.new_id("cmpl")
        if request.stream:
            return _sse(self._completion_stream(job, request, rid))
        outcome = await self._wait(http, job)
        return p.completion_response(rid, request.model, outcome.text, outcome.finish_reason, _usage(outcome))

    # -- the pieces ---------------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            message = f"The model `{model}` does not exist (this server serves `{self.settings.model_name}`)"
            raise ServeError(message, status=404, param="model", code="model_not_found")

    async def _submit(self, request: Any, ids: list[int], prompt_param: str) -> Job:
        """Check the request against the engine (400 naming the parameter) and queue it (429 when full)."""
        if not ids:
            raise ServeError("the prompt encodes to no tokens", param=prompt_param)
        limit = self.settings.max_tokens
        max_tokens = request.requested_tokens if request.requested_tokens is not None else limit
        if not 1 <= max_tokens <= limit:
            raise ServeError(f"max_tokens must be in 1..{limit}, got {max_tokens}", param="max_tokens")
        budget = self.worker.engine.spec.budget
        if request.kv_budget is not None and (budget is None or not 1 <= request.kv_budget <= budget):
            allowed = f"1..{budget}" if budget is not None else "not settable: this server keeps every token"
            raise ServeError(f"kv_budget must be {allowed}, got {request.kv_budget}", param="kv_budget")
        temperature = 1.0 if request.temperature is None else request.temperature
        seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(4), "little")
        sampling = SamplingParams(temperature, 1.0 if request.top_p is None else request.top_p, seed)
        stops = frozenset() if request.ignore_eos else self.settings.eos
        engine_request = EngineRequest(ids, max_tokens, sampling, stops, budget=request.kv_budget)
        try:
            self.worker.engine.validate(engine_request)  # reads only the spec and the pool's size
        except ValueError as err:
            raise ServeError(
                str(err), param="max_tokens" if "KV pool" in str(err) else prompt_param
            ) from None
        text = TextStream(self.tokenizer, ids, request.stop)
        job = Job(engine_request, text, asyncio.Queue(), asyncio.get_running_loop())
        engine_request.on_token = lambda token: self.worker.on_token(job, token)
        await asyncio.wrap_future(self.worker.submit(job))
        return job

    async def _wait(self, http: Request, job: Job) -> Outcome:
        """The outcome of a non-streamed request; a client that leaves cancels it."""
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    self.worker.cancel(job.request.id)
                    raise ServeError("client disconnected", status=499, code="cancelled") from None
                continue
            if kind == "done":
                return value
            if kind == "error":
                raise value

    async def _events(self, job: Job) -> AsyncIterator[tuple[str, Any]]:
        """A job's events until it is done; cancels it if the stream is closed early."""
        finished = False
        try:
            while True:
                kind, value = await job.events.get()
                finished = kind in ("done", "error")
                yield kind, value
                if finished:
                    return
        finally:
            if not finished:
                self.worker.cancel(job.request.id)

    async def _chat_stream(self, job: Job, request: p.ChatRequest, rid: str) -> AsyncIterator[str]:
        model = request.model
        yield _data(p.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        async for kind, value in self._events(job):
            if kind == "text":
                yield _data(p.chat_chunk(rid, model, {"content": value}))
            elif kind == "done":
                rest = job.text.delta(final=True)
                if rest:
                    yield _data(p.chat_chunk(rid, model, {"content": rest}))
                yield _data(p.chat_chunk(rid, model, {}, value.finish_reason))
                if request.include_usage:
                    yield _data(p.chat_chunk(rid, model, None, used=_usage(value)))
            else:
                yield _data(value.body())
        yield "data: [DONE]\n\n"

    async def _completion_stream(
        self, job: Job, request: p.CompletionRequest, rid: str
    ) -> AsyncIterator[str]:
        model = request.model
        async for kind, value in self._events(job):
            if kind == "text":
                yield _data(p.completion_response(rid, model, value, None))
            elif kind == "done":
                yield _data(
                    p.completion_response(rid, model, job.text.delta(final=True), value.finish_reason)
                )
                if request.include_usage:
                    body = p.completion_response(rid, model, "", None, used=_usage(value))
                    body["choices"] = []
                    yield _data(body)
            else:
                yield _data(value.body())
        yield "data: [DONE]\n\n"


async def _json(http: Request) -> Any:
    try:
        return json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ServeError(f"malformed JSON in the request body: {err}") from None


def _usage(outcome: Outcome) -> dict[str, Any]:
    c = outcome.completion
    return p.usage(c.prompt_tokens, len(c.token_ids), c.peak_cache_tokens, c.evictions)


def _data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _sse(stream: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
