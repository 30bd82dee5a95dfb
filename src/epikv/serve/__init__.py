"""``epikv serve``: an OpenAI-compatible server over the engine (continuous batching, admission by
KV slots, per-request eviction). :func:`build_app` wires a model, a spec and limits into an app."""

from __future__ import annotations

from typing import Any

from epikv.serve.app import ServeSettings, create_app


def build_app(
    model: Any,
    tokenizer: Any,
    spec: Any,
    limits: Any = None,
    model_name: str = "epikv",
    max_tokens: int = 2048,
) -> Any:
    """A FastAPI app serving ``model`` under ``spec`` (see :class:`epikv.spec.CacheSpec`) with
    :class:`epikv.engine.SchedulerLimits`; the engine thread starts with the app."""
    from epikv.engine import Engine
    from epikv.generation import eos_ids
    from epikv.serve.metrics import ServerMetrics
    from epikv.serve.worker import EngineWorker

    engine = Engine(model, spec, limits)
    worker = EngineWorker(engine, tokenizer, ServerMetrics(engine.scheduler.limits.kv_pool))
    settings = ServeSettings(model_name, max_tokens, frozenset(eos_ids(model, tokenizer)))
    return create_app(worker, tokenizer, settings)


__all__ = ["ServeSettings", "build_app", "create_app"]
