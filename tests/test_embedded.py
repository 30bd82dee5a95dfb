"""The cache on the embedded SmolLM2-135M-Instruct (real weights, no network)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import epikv
from epikv.generation import SamplingConfig, encode_prompts, generate


@pytest.fixture(scope="module")
def smol():
    from epikv.models import load_model

    return load_model()


def test_no_eviction_equals_plain_cache(smol):
    model, tok = smol
    ids, _ = encode_prompts(tok, ["Name three prime numbers."])
    ref = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, cache=DynamicCache())
    for name in ("epikv", "epikv-flat"):
        with epikv.attach(model, name, budget=4096) as cache:
            out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, cache=cache)
        assert torch.equal(out, ref), name


def test_eviction_is_bounded_and_keeps_true_positions(smol):
    model, tok = smol
    budget = 64
    result = generate(
        model,
        tok,
        ["Count from one to fifty in words."],
        "epikv-flat",
        budget,
        SamplingConfig(max_new_tokens=96, ignore_eos=True),
    )[0]
    assert result.tokens_generated == 96
    assert result.final_cache_tokens == budget and result.peak_cache_tokens == budget + 1
    assert result.evictions == result.prompt_tokens + 95 - budget
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", ["full", "streaming", "epikv-flat", "epikv", "h2o"])
def test_a_request_joining_a_running_batch_yields_what_it_yields_alone(smol, name):
    from epikv.engine import Engine, Request
    from epikv.generation import encode_prompt_ids
    from epikv.integration import build_spec

    model, tok = smol
    ids = encode_prompt_ids(tok, ["Name three prime numbers.", "What is 7 times 8?"])
    interval = 8 if name == "epikv" else None  # several compactions within 32 tokens
    spec = build_spec(model, name, 64, interval=interval)
    alone = [Engine(model, spec).run([Request(p, 32)])[0] for p in ids]
    engine, done = Engine(model, spec), {}
    first, second = Request(ids[0], 32), Request(ids[1], 32)
    engine.add(first)
    for step in range(80):
        if step == 9:
            engine.add(second)  # joins while the first is mid-generation (and already evicting)
        done.update((c.request_id, c) for c in engine.step())
    for request, want in zip((first, second), alone, strict=True):
        got = done[request.id]
        assert got.token_ids == want.token_ids, name
        assert (got.peak_cache_tokens, got.evictions) == (want.peak_cache_tokens, want.evictions)
        assert got.peak_cache_tokens <= spec.peak_tokens(got.prompt_tokens, 32)
    if name != "full":
        assert done[first.id].evictions > 0
