"""The clients of ``epikv bench serve``: streamed chat requests over HTTP and what they measured.

A closed loop of c clients, each sending its requests one after another; every request records the
arrival time of each content chunk and the usage of its last chunk. :func:`summarize_level` turns a
level's requests into aggregate tokens/s, time to first token and inter-token latency percentiles.
Nothing here starts or knows a server.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any


async def one_request(client: Any, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat request: arrival time of every content chunk and the final usage."""
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    arrivals, usage = [], {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter() - started)
    return {"arrivals": arrivals, "usage": usage, "seconds": time.perf_counter() - started}


async def closed_loop(url: str, prompts: list[str], clients: int, per_client: int, max_tokens: int) -> dict:
    """``clients`` clients each sending ``per_client`` requests back to back."""
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:

        async def run(index: int) -> list[dict[str, Any]]:
            out = []
            for k in range(per_client):
                prompt = prompts[(index * per_client + k) % len(prompts)]
                out.append(await one_request(client, url, prompt, max_tokens))
            return out

        started = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(clients)))
        wall = time.perf_counter() - started
    return summarize_level([r for rs in results for r in rs], wall)


def summarize_level(requests: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in requests)
    ttft = [r["arrivals"][0] for r in requests if r["arrivals"]]
    gaps = [b - a for r in requests for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    return {
        "requests": len(requests),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(gaps, 50),
        "itl_p99_s": _pct(gaps, 99),
        "peak_cache_tokens": max((r["usage"].get("peak_cache_tokens", 0) for r in requests), default=0),
        "max_prompt_tokens": max((r["usage"].get("prompt_tokens", 0) for r in requests), default=0),
    }


def _pct(values: list[float], q: float) -> float | None:
    """The q-th percentile, linearly interpolated between order statistics (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
