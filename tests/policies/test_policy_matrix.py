"""One matrix over every registered policy: invariants that must hold whatever the scores are."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

import epikv
from epikv.generation import SamplingConfig, generate
from epikv.integration.compat import cache_kwargs
from epikv.policies import policy_class, policy_names
from tests.helpers.models import policy_params

PROMPT = torch.tensor([[5, 17, 3, 44, 8, 9, 21, 60, 2, 11, 13, 70]])


@functools.cache  # one reference per model: every policy is compared with it
def plain_greedy(model, n):
    return model.generate(
        PROMPT, max_new_tokens=n, min_new_tokens=n, do_sample=False, **cache_kwargs(model, DynamicCache())
    )


@pytest.mark.exactness
@pytest.mark.parametrize("name", policy_names())
def test_no_eviction_equals_plain_cache(arch_model, name):
    n = 30
    budget = None if not policy_class(name).evicts else 10_000
    ref = plain_greedy(arch_model, n)
    with epikv.attach(arch_model, name, budget=budget, **policy_params(name)) as cache:
        out = arch_model.generate(
            PROMPT, max_new_tokens=n, min_new_tokens=n, do_sample=False, **cache_kwargs(arch_model, cache)
        )
    assert torch.equal(out, ref)
    assert cache.stats()[0].evictions == 0


@pytest.mark.parametrize("name", [n for n in policy_names() if policy_class(n).evicts])
def test_bounded_protected_ordered_under_eviction(arch_model, name):
    """At most K + tau tokens between compactions and K right after one. tau is capped at 4 (the
    defaults reach 128) so that every policy compacts many times and K + tau is a tight bound."""
    budget, n = 32, 60
    interval = min(policy_class(name)().interval, 4)
    seen_lengths = []
    with epikv.attach(arch_model, name, budget=budget, interval=interval, **policy_params(name)) as cache:
        ids = PROMPT
        logits = arch_model(input_ids=ids, **cache_kwargs(arch_model, cache), use_cache=True).logits
        for _ in range(n):
            token = logits[:, -1].argmax(-1, keepdim=True)
            compactions = cache.compactions
            logits = arch_model(input_ids=token, **cache_kwargs(arch_model, cache), use_cache=True).logits
            seen_lengths.append(cache.get_seq_length())
            if cache.compactions > compactions:
                assert seen_lengths[-1] <= budget, "a compaction left more than K tokens"
            pos = cache.layers[cache.model.cache_layers[0]].positions[0, 0].tolist()
            assert pos == sorted(pos), "positional order lost"
            assert all(p in pos for p in range(cache.policy.n_sink)), "sink evicted"
            if cache.policy.protect_prompt:
                assert all(p in pos for p in range(PROMPT.shape[1])), "prompt evicted"
        recent = cache.policy.recent_window(budget)
        seen = int(cache.seen[0])
        assert all(p in pos for p in range(seen - recent, seen)), "recent window evicted"
    assert cache.interval == interval
    assert max(seen_lengths) <= budget + interval
    assert cache.stats()[0].peak_cache_tokens <= budget + interval
    assert cache.compactions >= 2  # the K-after-compaction check ran more than once
    assert cache.stats()[0].evictions > 0


@pytest.mark.parametrize("name", [n for n in policy_names() if policy_class(n).evicts])
def test_runs_on_a_padded_batch(tiny_llama, name, tok):
    results = generate(
        tiny_llama,
        tok,
        ["a b c d e f", "a b"],
        name,
        budget=40,
        sampling=SamplingConfig(max_new_tokens=60, ignore_eos=True),
        **policy_params(name),
    )
    assert [r.tokens_generated for r in results] == [60, 60]
    assert all(r.peak_cache_tokens <= 40 + epikv.get_policy(name).interval for r in results)
