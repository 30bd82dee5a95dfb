"""Prometheus metrics of what the plugin did to each finished request, on ``vllm serve``'s ``/metrics``.

Every output of a planned request carries its latest counters (``kv_transfer_params["epikv"]``, set
by the scheduler). The front end's output processor keeps the latest per request while it runs
(:class:`Latest`) and counts a request once, when vLLM counts it finished (the same place that feeds
``vllm:request_success_total``: EOS, length, stop strings, errors, engine aborts), or when a client
aborts it (a disconnect: vLLM counts none, so neither does ``epikv:requests_total``; it goes to
``epikv:requests_aborted_total``). Nothing outlives its request (a failed request's epikv line travels
on its own output to its response: :mod:`epikv.vllm.answers`). Each metric carries vLLM's
``model_name`` label and ``finished_reason`` where vLLM has it.
"""

from __future__ import annotations

from typing import Any

KEY = "epikv"
_METRICS: dict[str, Any] = {}
PEAK_BUCKETS = tuple(float(2**i) for i in range(4, 18))  # 16 .. 131,072 tokens


def _metrics() -> dict[str, Any]:
    if not _METRICS:
        from prometheus_client import Counter, Histogram

        model = ["model_name"]
        _METRICS.update(
            peak=Histogram(
                "epikv:peak_cache_tokens",
                "Peak physical KV tokens of a finished request.",
                model,
                buckets=PEAK_BUCKETS,
            ),
            evicted=Counter(
                "epikv:evicted_tokens", "KV tokens evicted by EpiKV, over finished requests.", model
            ),
            compactions=Counter("epikv:compactions", "EpiKV compactions, over finished requests.", model),
            requests=Counter(
                "epikv:requests",
                "Finished requests of an EpiKV engine, counted where vLLM counts vllm:request_success.",
                [*model, "finished_reason"],
            ),
            aborted=Counter(
                "epikv:requests_aborted", "Requests of an EpiKV engine aborted by their client.", model
            ),
        )
    return _METRICS


def observe_finished(model: str, stats: dict[str, Any] | None, reason: str | None) -> None:
    """One request's end: its counters (when it ran), under ``reason`` (None: a client abort)."""
    m = _metrics()
    if reason is None:
        m["aborted"].labels(model).inc()
    else:
        m["requests"].labels(model, reason).inc()
    if stats and "peak_cache_tokens" in stats:
        m["peak"].labels(model).observe(stats["peak_cache_tokens"])
        m["evicted"].labels(model).inc(stats["evictions"])
        m["compactions"].labels(model).inc(stats["compactions"])


class Latest:
    """The latest counters of each running request of one engine, in the front end."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.stats: dict[str, dict[str, Any]] = {}
        self.aborting = False  # inside abort_requests (which recurses into a parent's children)

    def see(self, outputs: Any, running: Any) -> None:
        """Keep the counters on ``outputs`` of requests still ``running`` (late outputs of aborted
        ones are dropped, as vLLM drops them)."""
        for out in outputs:
            params = out.kv_transfer_params
            if params and KEY in params and out.request_id in running:
                self.stats[out.request_id] = params[KEY]

    def finished(self, req_id: str, reason: Any) -> None:
        observe_finished(self.model, self.stats.pop(req_id, None), None if reason is None else str(reason))


def with_choices(child: Any, params: dict[str, Any]) -> dict[str, Any]:
    """A child's output params (``n > 1``) with every child's latest counters so far, in choice order
    (``epikv_choices``): the parent's final output is made from one child's, so it carries them all.
    Kept on vLLM's parent request object, so they live exactly as long as it."""
    stats = params.get(KEY)
    if stats is None:
        return params
    parent = child.parent_req
    choices = parent.__dict__.setdefault("epikv_choices", {})
    choices[child.request_index] = stats
    return {**params, "epikv_choices": [choices[i] for i in sorted(choices)]}
