"""The two baselines of the equal-memory protocol (Random Attention, arXiv 2609.03430): the prompt and
the newest tokens (``streaming-prompt``), and random eviction drawn per KV head (``random-head``)."""

from __future__ import annotations

import pytest
import torch

from epikv.engine import Engine, Request
from epikv.integration import model_info
from epikv.spec import CacheSpec
from tests.helpers.engine import prompts

K = 24


def traced(model, spec: CacheSpec, prompt: list[int], n: int = 50) -> list[tuple[int, torch.Tensor]]:
    """(tokens generated, kept positions (layers, H, L)) after every compaction of one request."""
    trace: list = []
    Engine(model, spec).run([Request(prompt, n, on_compaction=lambda i, p: trace.append((i, p)))])
    return trace


def spec(model, name: str, **params) -> CacheSpec:
    return CacheSpec.build(model_info(model), name, K, params=params)


def test_streaming_prompt_keeps_the_prompt_and_the_newest_tokens(tiny_llama):
    prompt = prompts(1)[0]
    p = len(prompt)
    trace = traced(tiny_llama, spec(tiny_llama, "streaming-prompt"), prompt)
    assert len(trace) > 20
    for generated, kept in trace:
        seen = p + generated  # the cache holds the prompt and every token but the newest chosen
        want = [*range(p), *range(seen - (K - p), seen)]
        assert all(sorted(x for x in row.tolist() if x >= 0) == want for row in kept.flatten(0, 1))


def test_streaming_with_its_prompt_protected_is_not_that_baseline(tiny_llama):
    """``streaming`` protects K - 4 recent tokens: with the prompt protected too it would protect more
    than any K (``CacheSpec.min_budget`` looped for ever), so it is refused in one line naming
    ``streaming-prompt``, which protects the prompt and the shared window and fills K with the newest.
    With an explicit window it still builds."""
    with pytest.raises(ValueError, match="streaming-prompt"):
        spec(tiny_llama, "streaming", protect_prompt=True)
    assert spec(tiny_llama, "streaming", protect_prompt=True, recent=8).min_budget(20) == 28
    assert spec(tiny_llama, "streaming-prompt").protected_tokens(12) == 12 + K // 4


def test_random_head_keeps_a_set_per_layer_and_head_inside_the_protected_rule(tiny_llama):
    prompt = prompts(1)[0]
    p, window = len(prompt), min(128, K // 4)
    trace = traced(tiny_llama, spec(tiny_llama, "random-head", seed=3), prompt)
    differ = 0
    for generated, kept in trace:
        seen = p + generated
        sets = [frozenset(x for x in row.tolist() if x >= 0) for row in kept.flatten(0, 1)]
        assert all(len(s) == K for s in sets)
        assert all(s >= {*range(p), *range(seen - window, seen)} for s in sets)  # prompt, window
        differ += len(set(sets)) > 1
    assert kept.shape[:2] == (4, model_info(tiny_llama).num_kv_heads)
    assert differ == len(trace)  # drawn per head: the heads never agree


def test_random_head_is_seeded(tiny_llama):
    prompt = prompts(1)[0]
    runs = [traced(tiny_llama, spec(tiny_llama, "random-head", seed=s), prompt) for s in (3, 3, 4)]
    same = lambda a, b: all(torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True))  # noqa: E731
    assert same(runs[0], runs[1]) and not same(runs[0], runs[2])
