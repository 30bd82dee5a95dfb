"""``epikv serve``: an OpenAI-compatible server over the engine (continuous batching, admission by
KV slots, per-request eviction). :func:`build_app` wires a model, a spec and limits into an app."""

from __future__ import annotations

from typing import Any

from epikv.serve.app import ServeSettings, create_app
from epikv.serve.gate import Access
from epikv.serve.limits import ServeLimits


def build_app(
    model: Any,
    tokenizer: Any,
    spec: Any,
    limits: Any = None,
    model_name: str = "epikv",
    max_tokens: int = 2048,
    serve_limits: ServeLimits | None = None,
    access: Access | None = None,
) -> Any:
    """A FastAPI app serving ``model`` under ``spec`` (see :class:`epikv.spec.CacheSpec`) with
    :class:`epikv.engine.SchedulerLimits`, the HTTP :class:`ServeLimits` and :class:`Access` (API
    key); the engine thread starts with the app."""
    from epikv.engine import Engine
    from epikv.generation import eos_ids
    from epikv.serve.metrics import ServerMetrics
    from epikv.serve.worker import EngineWorker

    engine = Engine(model, spec, limits)
    worker = EngineWorker(engine, tokenizer, ServerMetrics(engine.scheduler.limits.kv_pool))
    vocab = model.get_input_embeddings().num_embeddings
    eos = frozenset(eos_ids(model, tokenizer))
    settings = ServeSettings(
        model_name, max_tokens, eos, vocab, serve_limits or ServeLimits(), access or Access()
    )
    return create_app(worker, tokenizer, settings)


__all__ = ["Access", "ServeLimits", "ServeSettings", "build_app", "create_app"]
