"""One check shared by the real-model tests: a request joining a running engine batch yields what it
yields alone (tokens, peak and evictions), and the peak stays within what the spec reserves."""

from __future__ import annotations

from typing import Any

from epikv.engine import Engine, Request


def check_joining_equals_alone(model: Any, spec: Any, ids: list[list[int]], label: Any = None) -> list[Any]:
    """Two prompts: the second joins at step 9 while the first is mid-generation (32 new tokens each).
    Asserts each completion equals its solo run; returns the batch's completions, first then second."""
    alone = [Engine(model, spec).run([Request(p, 32)])[0] for p in ids]
    engine, done = Engine(model, spec), {}
    first, second = Request(ids[0], 32), Request(ids[1], 32)
    engine.add(first)
    for step in range(80):
        if step == 9:
            engine.add(second)  # joins while the first is mid-generation (and may be evicting)
        done.update((c.request_id, c) for c in engine.step())
    for request, want in zip((first, second), alone, strict=True):
        got = done[request.id]
        assert got.token_ids == want.token_ids, (label, got.token_ids, want.token_ids)
        assert (got.peak_cache_tokens, got.evictions) == (want.peak_cache_tokens, want.evictions)
        assert got.peak_cache_tokens <= spec.peak_tokens(got.prompt_tokens, 32)
    return [done[first.id], done[second.id]]
