"""The cache on real Gemma 3 270M weights (gemma3_text: five sliding-window layers to each global one).

Slow (``pytest -m slow``; the load alone is about 45 s on one core) and it needs the weights:
``bash scripts/setup.sh --gemma3`` installs them (docs/gemma3-real-weights.md says where they come
from, under what terms, and how they are checked). Without them every test here fails with one line
naming that command: a missing model must not pass as a skip.

The long prompt is longer than the model's 512-token window, so the sliding layers really slide,
in the prefill and in every decode step after it.
"""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
import torch

import epikv
from epikv.generation import encode_prompt_ids, encode_prompts
from epikv.integration.compat import cache_kwargs
from tests.helpers.engine import check_joining_equals_alone

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
SHORT = "The history of the printing press begins"


def long_prompt(tokenizer, at_least: int = 600) -> str:
    """gsm8k problems (bundled data), one after another, until the prompt holds ``at_least`` tokens."""
    lines = files("epikv").joinpath("data/gsm8k.jsonl").read_text(encoding="utf-8").splitlines()
    text = "Here are some word problems.\n"
    for number, line in enumerate(lines, 1):
        text += f"\nProblem {number}: {json.loads(line)['problem']}\n"
        if len(tokenizer(text).input_ids) >= at_least:
            return text + "\nThe answer to problem 1 is"
    raise AssertionError("gsm8k is too short")  # pragma: no cover


@pytest.fixture(scope="module")
def gemma():
    from epikv.models.packaged import GEMMA3_270M, load_packaged

    try:
        return load_packaged(GEMMA3_270M, dtype=torch.float32)
    except ModuleNotFoundError as error:
        missing = str(error)  # failed outside the except: one line, no chained traceback
    pytest.fail(missing, pytrace=False)


@pytest.fixture(scope="module")
def prompts(gemma):
    _, tok = gemma
    return {"short": SHORT, "long": long_prompt(tok)}


def greedy(model, ids, new_tokens: int = NEW_TOKENS, **kwargs) -> torch.Tensor:
    return model.generate(
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs
    )


def test_plain_transformers_runs_the_hybrid_model(gemma, prompts):
    model, tok = gemma
    config = model.config
    assert config.model_type == "gemma3_text" and config.sliding_window == 512
    assert (
        config.layer_types.count("sliding_attention") == 15
        and config.layer_types.count("full_attention") == 3
    )
    assert next(model.parameters()).dtype == torch.float32
    ids, _ = encode_prompts(tok, [prompts["long"]])
    assert ids.shape[1] > config.sliding_window
    for name, prompt in prompts.items():
        ids, _ = encode_prompts(tok, [prompt])
        new = greedy(model, ids)[0, ids.shape[1] :]
        assert len(set(new.tolist())) > 4, (name, tok.decode(new))
        assert tok.decode(new, skip_special_tokens=True).strip(), name


@pytest.mark.parametrize("which", ["short", "long"])
def test_full_policy_generates_what_plain_generate_does(gemma, prompts, which):
    model, tok = gemma
    ids, _ = encode_prompts(tok, [prompts[which]])
    plain = greedy(model, ids)
    with epikv.attach(model, "full") as cache:
        ours = greedy(model, ids, **cache_kwargs(model, cache))
    assert ours[0].tolist() == plain[0].tolist(), (tok.decode(plain[0, ids.shape[1] :]), tok.decode(ours[0]))
    stats = cache.stats()[0]
    assert stats.evictions == 0 and stats.prompt_tokens == ids.shape[1]
    assert stats.final_cache_tokens == stats.tokens_seen == ids.shape[1] + NEW_TOKENS - 1


@pytest.mark.parametrize(
    ("name", "which"), [("streaming", "short"), ("streaming", "long"), ("epikv", "short")]
)
def test_an_evicting_policy_stays_within_its_budget(gemma, prompts, name, which):
    model, tok = gemma
    budget, new_tokens = 64, 96  # the short prompt plus 96 tokens overflows 64
    interval = 16 if name == "epikv" else None  # EpiKV's default tau (128) would not compact in 96
    ids, _ = encode_prompts(tok, [prompts[which]])
    handle = epikv.attach(model, name, budget=budget, interval=interval)
    with handle as cache:
        out = greedy(model, ids, new_tokens, **cache_kwargs(model, cache))
    info = epikv.model_info(model)
    assert len(info.sliding_layers) == 15 and len(info.cache_layers) == 3
    for i in info.sliding_layers:  # a ring of the window and one slot that padding writes to
        assert cache.layers[i].keys.shape[2] == info.window + 1 == 513
    for i in info.cache_layers:
        assert cache.layers[i].keys.shape[2] <= max(ids.shape[1], budget) + handle.spec.interval
    stats = cache.stats()[0]
    assert stats.tokens_seen == ids.shape[1] + new_tokens - 1
    assert stats.evictions > 0 and stats.evictions + stats.final_cache_tokens == stats.tokens_seen
    assert (
        stats.final_cache_tokens
        <= stats.peak_cache_tokens
        <= handle.spec.peak_tokens(ids.shape[1], new_tokens)
    )
    assert stats.final_cache_tokens <= budget + handle.spec.interval
    assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


@pytest.mark.parametrize(("name", "budget"), [("full", None), ("streaming", 64), ("epikv", 32)])
def test_a_request_in_a_batch_yields_what_it_yields_alone(gemma, prompts, name, budget):
    from epikv.integration import build_spec

    model, tok = gemma
    # Rows of 600+ and 8 tokens: the long one's windows slide while the short one joins. EpiKV keeps
    # its prompt whole, so it runs two short ones, at a budget both overflow, compacting every 8.
    other = "Janet's ducks lay 16 eggs per day."
    pair = [prompts["short"], other] if name == "epikv" else [prompts["long"], prompts["short"]]
    ids = encode_prompt_ids(tok, pair)
    spec = build_spec(model, name, budget, interval=8 if name == "epikv" else None)
    first, _ = check_joining_equals_alone(model, spec, ids, name)
    assert (first.evictions > 0) == (name != "full")
