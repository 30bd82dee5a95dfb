"""The ``vllm.general_plugins`` entry point: loaded by vLLM in every process before its config is built.

:func:`register` (idempotent) maps the capped KV cache spec to its manager in vLLM's registry and
wraps the platform's ``check_and_update_config`` so that a config carrying
``additional_config["epikv"]`` gets the plugin's worker and scheduler (unless the user named others)
and is checked once, at start-up, with one line per refusal; ``validate_request``, so a prompt
that cannot run under the budget is refused before it reaches the engine (an HTTP 400 under
``vllm serve``); and the front end's output processor, so finished requests' counters become
Prometheus metrics (:mod:`epikv.vllm.metrics`). Without that key nothing changes.
"""

from __future__ import annotations

from typing import Any

_DONE = False
_RULES: dict[str, Any] = {}  # the prompt rule of the engine configured last in this process


def register() -> None:
    global _DONE
    if _DONE:
        return
    from vllm.platforms import current_platform

    from epikv.vllm.scheduler import register_spec

    register_spec()
    platform = type(current_platform)
    check, validate = platform.check_and_update_config, platform.validate_request

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

    def validate_request(cls: Any, processed_inputs: Any, params: Any) -> None:
        validate(processed_inputs, params)
        rule = _RULES.get("prompt")
        tokens = processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) else None
        if rule is not None and tokens is not None:
            from vllm.exceptions import VLLMValidationError

            try:
                rule(len(tokens))
            except ValueError as err:  # a client error: HTTP 400 under vllm serve
                raise VLLMValidationError(str(err), parameter="prompt", value=len(tokens)) from err

    platform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]
    platform.validate_request = classmethod(validate_request)  # type: ignore[method-assign]
    _observe_outputs()
    _DONE = True


def _observe_outputs() -> None:
    """Count each finished request's counters into Prometheus as its output reaches the front end."""
    from vllm.v1.engine.output_processor import OutputProcessor

    from epikv.vllm.metrics import observe_outputs

    process = OutputProcessor.process_outputs

    def process_outputs(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        observe_outputs(engine_core_outputs)
        return process(self, engine_core_outputs, *args, **kwargs)

    OutputProcessor.process_outputs = process_outputs  # type: ignore[method-assign]


def _settings(vllm_config: Any) -> Any:
    from epikv.vllm.config import EpiKVSettings

    return EpiKVSettings.from_config(getattr(vllm_config, "additional_config", None))


def _check(settings: Any, vllm_config: Any) -> None:
    from epikv.vllm.config import SCHEDULER, WORKER, Refused, check_engine, check_prompt_fits, model_info

    spec = settings.spec(model_info(vllm_config))
    check_engine(vllm_config, spec)
    worker = vllm_config.parallel_config.worker_cls
    scheduler = vllm_config.scheduler_config.scheduler_cls
    if not _named(worker, WORKER) or not _named(scheduler, SCHEDULER):
        raise Refused(
            f"epikv: worker_cls must be {WORKER} and scheduler_cls {SCHEDULER} (or subclasses), got "
            f"{worker} and {scheduler}"
        )
    _RULES["prompt"] = lambda tokens: check_prompt_fits(spec, tokens)


def _named(value: Any, path: str) -> bool:
    if isinstance(value, str):
        return value == path
    from vllm.utils.import_utils import resolve_obj_by_qualname

    return isinstance(value, type) and issubclass(value, resolve_obj_by_qualname(path))
