"""Prometheus metrics of one server, in a registry of its own (several servers can share a process).

Requests by outcome, tokens generated, queue length, running rows, cached tokens, KV pool slots
reserved and held, evictions, time to first token, inter-token latency and end-to-end latency.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, kv_pool: int | None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("epikv_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.rejected = Counter(
            "epikv_requests_rejected", "Requests refused because the queue was full", registry=r
        )
        self.tokens = Counter("epikv_generated_tokens", "Tokens generated", registry=r)
        self.evictions = Counter("epikv_evicted_tokens", "Tokens evicted from finished requests", registry=r)
        self.tokens_per_s = Gauge(
            "epikv_tokens_per_second", "Tokens generated per second (last step)", registry=r
        )
        self.waiting = Gauge("epikv_queue_length", "Requests waiting for admission", registry=r)
        self.running = Gauge("epikv_running_rows", "Requests in the running batch", registry=r)
        self.running_peak = Gauge(
            "epikv_running_rows_peak", "Most requests ever in the running batch", registry=r
        )
        self.cached = Gauge("epikv_cached_tokens", "Tokens held in the KV cache", registry=r)
        self.reserved = Gauge(
            "epikv_kv_pool_reserved_slots", "KV slots reserved by running requests", registry=r
        )
        self.pool = Gauge("epikv_kv_pool_slots", "KV slots in the pool (0 = unlimited)", registry=r)
        self.ttft = Histogram(
            "epikv_time_to_first_token_seconds", "Time to first token", buckets=LATENCY, registry=r
        )
        self.itl = Histogram(
            "epikv_inter_token_latency_seconds", "Time between tokens", buckets=LATENCY, registry=r
        )
        self.e2e = Histogram("epikv_request_seconds", "Request latency", buckets=LATENCY, registry=r)
        self.pool.set(kv_pool or 0)
        self._tokens_seen = 0
        self._peak = 0

    def stepped(self, engine: Any, seconds: float) -> None:
        live = engine.live_stats()
        new = engine.tokens_out - self._tokens_seen
        self._tokens_seen = engine.tokens_out
        self.tokens.inc(new)
        if seconds > 0:
            self.tokens_per_s.set(new / seconds)
        self.waiting.set(live["waiting"])
        self.running.set(live["running"])
        self._peak = max(self._peak, live["running"])
        self.running_peak.set(self._peak)
        self.cached.set(live["cached_tokens"])
        self.reserved.set(live["reserved_slots"])

    def finished(self, outcome: str, completion: Any, job: Any = None) -> None:
        self.requests.labels(outcome).inc()
        if completion is not None:
            self.evictions.inc(completion.evictions)
        if job is not None:
            self.e2e.observe(time.perf_counter() - job.submitted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
