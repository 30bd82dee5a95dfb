"""The ``vllm.general_plugins`` entry point: loaded by vLLM in every process before its config is built.

:func:`register` (idempotent) maps the capped KV cache spec to its manager in vLLM's registry and
wraps, each keyed by the engine it belongs to (its own ``vllm_config``), never by a process-global:
- the platform's ``check_and_update_config``, so a config carrying ``additional_config["epikv"]``
  gets the plugin's worker and scheduler (unless the user named others) and is checked once, at
  start-up, with one line per refusal;
- the front end's input processor, so a request that cannot run under its budget (or names a bad
  ``epikv_budget``) is refused before it reaches the engine (an HTTP 400 under ``vllm serve``); the
  scheduler checks the same rule again for inputs that come another way;
- beam search, refused per request in one line (each beam step is a new request that never evicts);
- the front end's output processor, so each finished request's counters become Prometheus metrics
  (:mod:`epikv.vllm.metrics`), labelled with the engine's served model name;
- the OpenAI chat and completion streams, so the chunk with a finish reason carries the request's
  counters (``kv_transfer_params``, as the non-streamed responses do).
Without that key nothing changes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
_DONE = False
_GUARD_LOGGED: set[str] = set()


def _guard(what: str, call: Callable[[], Any]) -> Any:
    """Run epikv's own bookkeeping inside a path of vLLM's front end: an exception is logged (once
    per kind) and dropped, never raised into vLLM's output handler, where it would end the engine for
    every client (``EngineDeadError``). What it would have added (a counter, a line) is skipped."""
    try:
        return call()
    except Exception:
        if what not in _GUARD_LOGGED:
            _GUARD_LOGGED.add(what)
            log.exception("epikv: %s failed and was skipped (vLLM serves on; logged once)", what)
        return None


def register() -> None:
    global _DONE
    if _DONE:
        return
    from vllm.platforms import current_platform

    from epikv.vllm.scheduler import register_spec

    register_spec()
    platform = type(current_platform)
    check = platform.check_and_update_config

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        settings = _settings(vllm_config)
        if settings is not None:
            from epikv.vllm.config import SCHEDULER, WORKER

            if vllm_config.parallel_config.worker_cls == "auto":
                vllm_config.parallel_config.worker_cls = WORKER
            if vllm_config.scheduler_config.scheduler_cls is None:
                vllm_config.scheduler_config.scheduler_cls = SCHEDULER
        check(vllm_config)
        if settings is not None:
            _check(settings, vllm_config)

    platform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]
    _wrap_inputs()
    _wrap_beam_search()
    _wrap_outputs()
    _wrap_chat_stream()
    _wrap_errors()
    _DONE = True


def _settings(vllm_config: Any) -> Any:
    from epikv.vllm.config import EpiKVSettings

    return EpiKVSettings.from_config(getattr(vllm_config, "additional_config", None))


def _check(settings: Any, vllm_config: Any) -> None:
    from epikv.vllm.config import SCHEDULER, WORKER, Refused, model_info
    from epikv.vllm.refusals import check_engine

    check_engine(vllm_config, settings.spec(model_info(vllm_config)))
    worker = vllm_config.parallel_config.worker_cls
    scheduler = vllm_config.scheduler_config.scheduler_cls
    if not _named(worker, WORKER) or not _named(scheduler, SCHEDULER):
        raise Refused(
            f"epikv: worker_cls must be {WORKER} and scheduler_cls {SCHEDULER} (or subclasses), got "
            f"{worker} and {scheduler}"
        )


def _named(value: Any, path: str) -> bool:
    if isinstance(value, str):
        return value == path
    from vllm.utils.import_utils import resolve_obj_by_qualname

    return isinstance(value, type) and issubclass(value, resolve_obj_by_qualname(path))


def engine_spec(owner: Any, vllm_config: Any) -> Any:
    """The run spec of the engine ``owner`` belongs to (built once per owner; None without the key)."""
    if not hasattr(owner, "_epikv_spec"):
        from epikv.vllm.config import model_info

        settings = _settings(vllm_config)
        owner._epikv_spec = settings.spec(model_info(vllm_config)) if settings is not None else None
    return owner._epikv_spec


def _wrap_inputs() -> None:
    """Refuse, in the front end, what the engine's rule refuses (a 400 under ``vllm serve``)."""
    from vllm.v1.engine.input_processor import InputProcessor

    process = InputProcessor.process_inputs

    @functools.wraps(process)
    def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = process(self, *args, **kwargs)
        spec = engine_spec(self, self.vllm_config)
        if spec is not None and request.prompt_token_ids is not None:
            _admit(spec, request, getattr(self, "epikv_pool", None), self.vllm_config.cache_config.block_size)
        return request

    InputProcessor.process_inputs = process_inputs  # type: ignore[method-assign]


def _admit(spec: Any, request: Any, pool: int | None, block_size: int) -> None:
    """The request rule (a bad budget, also under ``full``) and, once the front end knows one
    replica's pool (``pool``, usable blocks; None for hybrids, whose windows only the scheduler
    counts), the pool rule: each a 400 naming the request's field."""
    from vllm.exceptions import VLLMValidationError

    from epikv.errors import AdmissionError
    from epikv.vllm.config import BUDGET_ARG, check_pool, plan_request

    params = request.sampling_params
    if params is None:  # pooling: nothing is generated, nothing evicted
        return
    tokens = len(request.prompt_token_ids)
    try:
        plan = plan_request(spec, tokens, params.max_tokens, params.extra_args)
        if pool is not None and plan.reserve is not None:
            check_pool(plan, block_size, pool)
    except AdmissionError as err:
        name, value = {
            "budget": (BUDGET_ARG, (params.extra_args or {}).get(BUDGET_ARG)),
            "max_new_tokens": ("max_tokens", params.max_tokens),
        }.get(err.field, ("prompt", tokens))
        raise VLLMValidationError(f"epikv: {err}", parameter=name, value=value) from err


def _wrap_beam_search() -> None:
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
    from vllm.exceptions import VLLMValidationError

    why = (
        "epikv: beam search is not supported: each beam step is a new request that prefills the "
        "prompt and beam again, so nothing is ever evicted"
    )
    offline, online = BeamSearchOfflineMixin.beam_search, BeamSearchOnlineMixin.beam_search

    @functools.wraps(offline)
    def offline_search(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _settings(self.llm_engine.vllm_config) is not None:
            raise VLLMValidationError(why, parameter="use_beam_search")
        return offline(self, *args, **kwargs)

    @functools.wraps(online)
    async def online_search(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _settings(self.engine_client.vllm_config) is not None:
            raise VLLMValidationError(why, parameter="use_beam_search")
        async for out in online(self, *args, **kwargs):
            yield out

    BeamSearchOfflineMixin.beam_search = offline_search  # type: ignore[method-assign]
    BeamSearchOnlineMixin.beam_search = online_search  # type: ignore[method-assign]


def _wrap_outputs() -> None:
    """Count each request of an epikv engine once, where vLLM counts it (:mod:`epikv.vllm.metrics`)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.output_processor import OutputProcessor

    from epikv.vllm.metrics import Latest

    for engine in (AsyncLLM, LLMEngine):
        _after_init(engine, Latest)
    process, finished = OutputProcessor.process_outputs, OutputProcessor._update_stats_from_finished
    abort = OutputProcessor.abort_requests

    @functools.wraps(process)
    def process_outputs(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        latest = getattr(self, "epikv_latest", None)
        if latest is not None:
            _guard("reading a step's counters", lambda: _see(self, latest, engine_core_outputs))
        return process(self, engine_core_outputs, *args, **kwargs)

    @functools.wraps(finished)
    def update_stats_from_finished(self: Any, req_state: Any, finish_reason: Any, *args: Any) -> Any:
        latest = getattr(self, "epikv_latest", None)
        if latest is not None:
            count = functools.partial(latest.finished, req_state.request_id, finish_reason)
            _guard("counting a finished request", count)
        return finished(self, req_state, finish_reason, *args)

    @functools.wraps(abort)
    def abort_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        latest = getattr(self, "epikv_latest", None)
        if latest is None or latest.aborting:  # a parent's children: the outer call counts them
            return abort(self, *args, **kwargs)
        latest.aborting = True
        try:
            aborted = abort(self, *args, **kwargs)
        finally:
            latest.aborting = False
        for req_id in aborted:
            _guard("counting an aborted request", lambda r=req_id: latest.finished(r, None))
        return aborted

    OutputProcessor.process_outputs = process_outputs  # type: ignore[method-assign]
    OutputProcessor._update_stats_from_finished = update_stats_from_finished  # type: ignore[method-assign]
    OutputProcessor.abort_requests = abort_requests  # type: ignore[method-assign]


def _see(processor: Any, latest: Any, outputs: Any) -> None:
    """A step's counters into ``latest``; a child's (n > 1) onto its output with its siblings'."""
    from epikv.vllm.metrics import with_choices

    latest.see(outputs, processor.request_states)
    for out in outputs:
        state = processor.request_states.get(out.request_id)
        if state is not None and state.parent_req is not None and out.kv_transfer_params:
            out.kv_transfer_params = with_choices(state, out.kv_transfer_params)


def _after_init(engine: type, latest: type) -> None:
    """Give the engine's output processor its per-engine counters when the engine runs epikv."""
    init = engine.__init__

    @functools.wraps(init)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        init(self, vllm_config, *args, **kwargs)
        if _settings(vllm_config) is not None:
            name = vllm_config.model_config.served_model_name
            model = name[0] if isinstance(name, list | tuple) else str(name)
            self.output_processor.epikv_latest = latest(model)
            self.input_processor.epikv_pool = _replica_pool(self)

    engine.__init__ = __init__  # type: ignore[method-assign]


def _replica_pool(engine: Any) -> int | None:
    """Usable KV blocks of one data-parallel replica, as this front end learnt them at start-up: vLLM
    sums the pools of the engines a client manages (``core_engines``; one in process), and each has
    a null block. None for a hybrid (its sliding windows need blocks only the scheduler counts) or
    before any pool is known."""
    from epikv.vllm.config import model_info

    total = engine.vllm_config.cache_config.num_gpu_blocks
    if not total or model_info(engine.vllm_config).sliding_layers:
        return None
    engines = len(getattr(engine.engine_core, "core_engines", None) or [None])
    return total // engines - 1


def _wrap_errors() -> None:
    """A request the worker or scheduler failed (vLLM's ``error`` finish) answers with the epikv
    line (vLLM's 500 says only "Internal server error"): the front end's counters keep each failed
    request's line (:class:`epikv.vllm.metrics.Latest`) until its response is built."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.exceptions import GenerationError

    raise_if_error = GenerateBaseServing._raise_if_error

    @functools.wraps(raise_if_error)
    def _raise_if_error(self: Any, finish_reason: str | None, request_id: str) -> None:
        if finish_reason == "error":
            latest = getattr(getattr(self.engine_client, "output_processor", None), "epikv_latest", None)
            find = functools.partial(latest.error_of, request_id) if latest is not None else None
            message = _guard("finding a failed request's line", find) if find is not None else None
            if message is not None:
                raise GenerationError(message)
        raise_if_error(self, finish_reason, request_id)

    GenerateBaseServing._raise_if_error = _raise_if_error  # type: ignore[method-assign]


def _wrap_chat_stream() -> None:
    """The streamed chat and completion responses: each chunk that finishes a choice carries
    ``kv_transfer_params`` (the counters of that request's last output), as vLLM's non-streamed
    responses do."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    _tap_stream(OpenAIServingChat, "chat_completion_stream_generator", 1, lambda res: res)
    # the completion stream's results are (prompt index, output) pairs
    _tap_stream(OpenAIServingCompletion, "completion_stream_generator", 2, lambda pair: pair[1])


def _tap_stream(cls: Any, name: str, position: int, output_of: Any) -> None:
    """Wrap ``cls.name``, an async generator of SSE chunks whose argument ``position`` (after self)
    is the engine's result generator: the counters of each finished result go on the next chunk
    with a finish reason (vLLM emits a result's chunk right after reading it)."""
    import json
    from collections import deque

    stream = getattr(cls, name)

    @functools.wraps(stream)
    async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _settings(self.engine_client.vllm_config) is None:
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
                chunk = (
                    _guard("adding counters to a stream", functools.partial(with_counters, chunk)) or chunk
                )
            yield chunk

    setattr(cls, name, wrapped)
