"""Engine requests and checks the tests share: short intervals so every evicting policy compacts
within a short test, seeded prompts, a spec per policy, an ``on_logits`` recorder, and the check that
a request joining a running batch yields what it yields alone."""

from __future__ import annotations

from typing import Any

import torch

from epikv.engine import Engine, Request
from epikv.integration import build_spec
from epikv.policies import policy_class
from tests.helpers.models import policy_params

# Short intervals so that every evicting policy compacts many times within a short test.
INTERVALS = {"epikv-seg": 4, "epikv-segq": 4, "snapkv": 4, "rkv": 4, "lagkv": 4, "thinkv": 4}
# ThinKV's K-means keeps the member nearest each centroid: a choice that flips on the last-bit
# differences a different batch shape makes (batched matmuls block differently). Its logits agree
# until its first compaction; after that it may keep another member of a cluster.
FLOAT_SENSITIVE = {"thinkv"}


def prompts(count: int = 4, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 97, (n,), generator=g).tolist() for n in (12, 5, 20, 9)[:count]]


def spec_for(model, name: str, budget: int = 32):
    budget = budget if policy_class(name).evicts else None
    return build_spec(model, name, budget, interval=INTERVALS.get(name), params=policy_params(name))


class Logits:
    """on_logits recorder."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.evicted: list[bool] = []

    def __call__(self, index: int, logits: torch.Tensor, evicted: bool) -> None:
        self.rows.append(logits.detach().clone())
        self.evicted.append(evicted)


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
