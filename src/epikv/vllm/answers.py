"""How ``vllm serve`` answers a request of an epikv engine, beyond vLLM's own answer: the front end's
refusals before any stream starts, a failed request's epikv line in its error, and the counters on a
streamed response's finishing chunk. Installed by :func:`epikv.vllm.plugin.register`; each wrapper
passes straight through for an engine without ``additional_config["epikv"]``.

- ``AsyncLLM.generate`` (what the OpenAI server calls, synchronously, before it answers): the
  plugin's request rule runs on the rendered prompt before the request's generator exists, so a
  refused request is an HTTP 400 naming its field, streamed or not, as vLLM's own parameter errors
  are (the input processor checks it again, for callers that come another way). Its outputs are
  read on their way to the response: a request the plugin failed raises, in that response only,
  a 400 naming the field when the engine refused it (it can never run: retrying cannot help), and
  otherwise vLLM's 500 with the epikv line (its output carries the line, so no store keyed by any
  id is needed).
- ``OpenAIServingChat.create_chat_completion``: a chat's prompt is its ``messages`` (what a 400 for
  a prompt names), a completion's its ``prompt``.
- the chat and completion streams: the chunk with a finish reason carries the request's counters
  (``kv_transfer_params``, as the non-streamed responses do).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Mapping
from typing import Any

KEY = "epikv"


def wrap_generate(enabled: Any, check: Any, prompt_field: Any) -> None:
    """Wrap ``AsyncLLM.generate``: ``enabled(vllm_config)`` says whether the engine runs epikv,
    ``check(input_processor, prompt_tokens, params)`` raises the front end's 400, ``prompt_field``
    (a context variable) names the prompt's field."""
    from vllm.v1.engine.async_llm import AsyncLLM

    generate = AsyncLLM.generate

    @functools.wraps(generate)
    def checked(self: Any, prompt: Any, sampling_params: Any, *args: Any, **kwargs: Any) -> Any:
        if not enabled(self.vllm_config):
            return generate(self, prompt, sampling_params, *args, **kwargs)
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, Mapping) else None
        if ids is not None and hasattr(sampling_params, "extra_args"):
            check(self.input_processor, len(ids), sampling_params)
        field = prompt_field.get()
        return answered(generate(self, prompt, sampling_params, *args, **kwargs), field)

    AsyncLLM.generate = checked  # type: ignore[method-assign]


async def answered(outputs: AsyncIterator[Any], prompt_field: str) -> AsyncIterator[Any]:
    """``outputs`` (one request's), with a request the plugin failed raised as its error instead of
    its final output (:func:`failure`)."""
    failed = None
    async for out in outputs:
        failed = failure(out, prompt_field)
        if failed is None:
            yield out
    if failed is not None:
        raise failed


def failure(out: Any, prompt_field: str) -> Exception | None:
    """The error a finished output of a request the plugin failed answers with (None otherwise, or
    when vLLM failed it: vLLM's own 500 then): a 400 naming the field for a refusal (the request can
    never run on this engine), vLLM's 500 with the epikv line for a fault."""
    from vllm.exceptions import GenerationError, VLLMValidationError

    from epikv.vllm.config import REQUEST_FIELDS

    if not out.finished or not any(o.finish_reason == "error" for o in out.outputs):
        return None
    params = out.kv_transfer_params or {}
    # n > 1: the parent's output carries one child's counters, and every child's in choice order
    seen = [params.get(KEY) or {}, *params.get("epikv_choices", ())]
    stats = next((s for s in seen if "error" in s), None)
    if stats is None:
        return None
    line = stats["error"]
    refused = stats.get("refused")
    if refused is None:
        return GenerationError(line)
    return VLLMValidationError(line, parameter=REQUEST_FIELDS.get(refused, prompt_field))


def wrap_chat_field(prompt_field: Any) -> None:
    """While a chat completion is built, the prompt's field is ``messages``."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    create = OpenAIServingChat.create_chat_completion

    @functools.wraps(create)
    async def create_chat_completion(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = prompt_field.set("messages")
        try:
            return await create(self, *args, **kwargs)
        finally:
            prompt_field.reset(token)

    OpenAIServingChat.create_chat_completion = create_chat_completion  # type: ignore[method-assign]


def wrap_chat_stream(enabled: Any, guard: Any) -> None:
    """The streamed chat and completion responses: each chunk that finishes a choice carries
    ``kv_transfer_params`` (the counters of that request's last output), as vLLM's non-streamed
    responses do. ``enabled(vllm_config)``: whether the engine runs epikv; ``guard(what, call)``: runs
    epikv's own bookkeeping so that it can never break vLLM's stream."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    _tap_stream(OpenAIServingChat, "chat_completion_stream_generator", 1, lambda res: res, enabled, guard)
    # the completion stream's results are (prompt index, output) pairs
    tap_completion = functools.partial(_tap_stream, OpenAIServingCompletion, "completion_stream_generator")
    tap_completion(2, lambda pair: pair[1], enabled, guard)


def _tap_stream(cls: Any, name: str, position: int, output_of: Any, enabled: Any, guard: Any) -> None:
    """Wrap ``cls.name``, an async generator of SSE chunks whose argument ``position`` (after self)
    is the engine's result generator: the counters of each finished result go on the next chunk
    with a finish reason (vLLM emits a result's chunk right after reading it)."""
    import json
    from collections import deque

    stream = getattr(cls, name)

    @functools.wraps(stream)
    async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not enabled(self.engine_client.vllm_config):
            async for chunk in stream(self, *args, **kwargs):
                yield chunk
            return
        finished: deque[dict[str, Any]] = deque()
        results = args[position]

        async def tap() -> Any:
            async for item in results:
                res = output_of(item)
                if res.finished and res.kv_transfer_params:
                    finished.append(res.kv_transfer_params)
                yield item

        args = (*args[:position], tap(), *args[position + 1 :])

        def with_counters(chunk: str) -> str:
            data = json.loads(chunk[len("data: ") :])
            if any(c.get("finish_reason") for c in data.get("choices", ())):
                data["kv_transfer_params"] = finished.popleft()
                return f"data: {json.dumps(data)}\n\n"
            return chunk

        async for chunk in stream(self, *args, **kwargs):
            if finished and chunk.startswith("data: {"):
                chunk = guard("adding counters to a stream", functools.partial(with_counters, chunk)) or chunk
            yield chunk

    setattr(cls, name, wrapped)
