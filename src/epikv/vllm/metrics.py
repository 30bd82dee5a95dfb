"""Prometheus metrics of what the plugin did to each finished request, on ``vllm serve``'s ``/metrics``.

The counters ride on each finished request's output (``kv_transfer_params["epikv"]``, set by the
scheduler); the front-end process observes them as outputs pass through vLLM's output processor, and
the metrics live in prometheus_client's default registry, which vLLM's ``/metrics`` serves.
"""

from __future__ import annotations

from typing import Any

_METRICS: dict[str, Any] = {}
PEAK_BUCKETS = tuple(float(2**i) for i in range(4, 18))  # 16 .. 131,072 tokens


def _metrics() -> dict[str, Any]:
    if not _METRICS:
        from prometheus_client import Counter, Histogram

        _METRICS.update(
            peak=Histogram(
                "epikv:peak_cache_tokens",
                "Peak physical KV tokens of a finished request.",
                buckets=PEAK_BUCKETS,
            ),
            evicted=Counter("epikv:evicted_tokens", "KV tokens evicted by EpiKV, over finished requests."),
            compactions=Counter("epikv:compactions", "EpiKV compactions, over finished requests."),
            requests=Counter("epikv:requests", "Finished requests whose KV cache EpiKV ran."),
        )
    return _METRICS


def observe_finished(stats: dict[str, int]) -> None:
    """One finished request's counters (``peak_cache_tokens``, ``evictions``, ``compactions``)."""
    m = _metrics()
    m["peak"].observe(stats["peak_cache_tokens"])
    m["evicted"].inc(stats["evictions"])
    m["compactions"].inc(stats["compactions"])
    m["requests"].inc()


def observe_outputs(outputs: Any) -> None:
    """Observe the finished ones among a step's engine-core outputs."""
    for out in outputs:
        params = out.kv_transfer_params
        if out.finish_reason is not None and params and "epikv" in params:
            observe_finished(params["epikv"])
