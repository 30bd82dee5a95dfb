"""The ``vllm.general_plugins`` entry point: loaded by vLLM in every process before its config is built.

:func:`register` (idempotent) maps the capped KV cache spec to its manager in vLLM's registry and
wraps, each keyed by the engine it belongs to (its own ``vllm_config``), never by a process-global:
- the platform's ``check_and_update_config``, so a config carrying ``additional_config["epikv"]``
  gets the plugin's worker and scheduler (unless the user named others) and is checked once, at
  start-up, with one line per refusal;
- the front end's input processor, so a request that cannot run under its budget (or names a bad
  ``epikv_budget``) is refused before it reaches the engine; the scheduler checks the same rule
  again for inputs that come another way;
- beam search, refused per request in one line (each beam step is a new request that never evicts);
- the front end's output processor, so each finished request's counters become Prometheus metrics
  (:mod:`epikv.vllm.metrics`), labelled with the engine's served model name;
- what ``vllm serve`` answers (:mod:`epikv.vllm.answers`): a refusal is an HTTP 400 before any
  stream starts, a request the plugin failed answers with its epikv line (a 400 when it can never
  run, vLLM's 500 otherwise), and a stream's finishing chunk carries the request's counters.
Without that key nothing changes.
"""

from __future__ import annotations

import contextvars
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
    _wrap_answers()
    _DONE = True


def _wrap_answers() -> None:
    """What ``vllm serve`` answers (:mod:`epikv.vllm.answers`)."""
    from epikv.vllm import answers

    answers.wrap_generate(lambda config: _settings(config) is not None, _check_request, PROMPT_FIELD)
    answers.wrap_chat_field(PROMPT_FIELD)
    answers.wrap_chat_stream(lambda config: _settings(config) is not None, _guard)


def _settings(vllm_config: Any) -> Any:
    from epikv.vllm.config import EpiKVSettings

    return EpiKVSettings.from_config(getattr(vllm_config, "additional_config", None))


def _check(settings: Any, vllm_config: Any) -> None:
    from epikv.vllm.config import SCHEDULER, WORKER, Refused, model_info
    from epikv.vllm.refusals import check_engine

    spec = settings.spec(model_info(vllm_config))
    check_engine(vllm_config, spec)
    if spec.evicts:
        log.info(
            "epikv: %s; each request holds at most its cap and is charged min(cap, prompt + max_tokens, "
            "max_model_len); a prompt is held whole until its first compaction, so vLLM's start-up check "
            "and auto-fit count one request of max_model_len tokens as in plain vLLM",
            spec.describe(),
        )
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
        if request.prompt_token_ids is not None:
            _check_request(self, len(request.prompt_token_ids), request.sampling_params)
        return request

    InputProcessor.process_inputs = process_inputs  # type: ignore[method-assign]


def _check_request(processor: Any, prompt_tokens: int, params: Any) -> None:
    """The front end's check of one request on ``processor``'s engine (nothing without the key)."""
    spec = engine_spec(processor, processor.vllm_config)
    if spec is not None:
        config, pool = processor.vllm_config, getattr(processor, "epikv_pool", None)
        block, context = config.cache_config.block_size, config.model_config.max_model_len
        _admit(spec, prompt_tokens, params, pool, block, context)


PROMPT_FIELD: contextvars.ContextVar[str] = contextvars.ContextVar("epikv_prompt_field", default="prompt")
"""The request field that holds the prompt, as the OpenAI endpoint being served names it (``messages``
for a chat); set by :func:`_wrap_chat_field` for the call that builds the request."""


def _admit(
    spec: Any, tokens: int, params: Any, pool: int | None, block_size: int, max_model_len: int
) -> None:
    """The request rule (a bad budget or rho, also under ``full``) and, once the front end knows one
    replica's pool (``pool``, usable blocks; None for hybrids, whose windows only the scheduler
    counts), the pool rule: each a 400 naming the request's field (the prompt when the prompt alone
    passes the pool, ``max_tokens`` when a smaller one would fit)."""
    from vllm.exceptions import VLLMValidationError

    from epikv.errors import AdmissionError
    from epikv.vllm.config import check_pool, plan_request

    if params is None:  # pooling: nothing is generated, nothing evicted
        return
    try:
        plan = plan_request(spec, tokens, params.max_tokens, params.extra_args, max_model_len)
        if pool is not None and plan.reserve is not None:
            check_pool(spec, plan, tokens, block_size, pool)
    except AdmissionError as err:
        name, value = _field(err.field, params, tokens)
        raise VLLMValidationError(f"epikv: {err}", parameter=name, value=value) from err


def _field(field: str, params: Any, tokens: int) -> tuple[str, Any]:
    """The OpenAI request parameter (and its value) an admission error's ``field`` blames."""
    from epikv.vllm.config import REQUEST_FIELDS

    name = REQUEST_FIELDS.get(field)
    if name == "max_tokens":
        return name, params.max_tokens
    if name is not None:
        return name, (params.extra_args or {}).get(name)
    return PROMPT_FIELD.get(), tokens


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
