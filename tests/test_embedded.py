"""The cache on the embedded SmolLM2-135M-Instruct (real weights, no network)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import epikv
from epikv.generation import SamplingConfig, encode_prompts, generate
from epikv.integration.compat import cache_kwargs
from tests.helpers.engine import check_joining_equals_alone


@pytest.fixture(scope="module")
def smol():
    from epikv.models import load_model

    return load_model()


@pytest.mark.exactness
def test_no_eviction_equals_plain_cache(smol):
    model, tok = smol
    ids, _ = encode_prompts(tok, ["Name three prime numbers."])
    ref = model.generate(
        ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, **cache_kwargs(model, DynamicCache())
    )
    for name in ("epikv", "epikv-flat"):
        with epikv.attach(model, name, budget=4096) as cache:
            out = model.generate(
                ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, **cache_kwargs(model, cache)
            )
        assert torch.equal(out, ref), name


@pytest.mark.exactness
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
    from epikv.generation import encode_prompt_ids
    from epikv.integration import build_spec

    model, tok = smol
    ids = encode_prompt_ids(tok, ["Name three prime numbers.", "What is 7 times 8?"])
    interval = 8 if name == "epikv" else None  # several compactions within 32 tokens
    first, _ = check_joining_equals_alone(model, build_spec(model, name, 64, interval=interval), ids, name)
    if name != "full":
        assert first.evictions > 0
