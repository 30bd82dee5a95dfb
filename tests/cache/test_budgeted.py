"""The budgeted cache on tiny models: true positions, kept set, counters, batching, errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from transformers import DynamicCache

import epikv
from epikv.cache.window import WindowLayer
from epikv.generation import SamplingConfig, generate
from epikv.integration.compat import cache_kwargs
from epikv.policies.base import CacheView, Policy, global_scores

PROMPT = torch.tensor([[5, 17, 3, 44, 8, 9, 21, 60, 2, 11]])


@dataclass(frozen=True)
class Recording(Policy):
    """Scores each slot by a fixed pseudo-random function of its position and records every call."""

    name: ClassVar[str] = "recording"
    calls: ClassVar[list] = []

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        pos = view.positions(0)[:, 0, :].float()
        scores = torch.sin(pos * 12.9898) * 43758.5453 % 1.0
        Recording.calls.append((pos.clone(), scores.clone(), view.valid.clone()))
        return global_scores(scores)


def decode(model, cache, ids, n):
    logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits
    tokens = []
    for _ in range(n):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
        logits = model(input_ids=token, **cache_kwargs(model, cache), use_cache=True).logits
    return tokens, logits


def kept_states(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values of row 0 as a plain cache would hold them for the next token: an
    evicting layer's kept slots; a sliding layer's last W-1 tokens (its ring's, by true position)."""
    out = []
    for layer in cache.layers:
        k, v = layer.keys[:1].clone(), layer.values[:1].clone()
        if isinstance(layer, WindowLayer):
            ring = layer.windows
            pos, valid = ring.arena.positions[0, 0, 0].long(), ring.arena.valid[0]
            order = [s for s in pos.argsort().tolist() if valid[s]][-(ring.window - 1) :]
            k, v = k[:, :, order], v[:, :, order]
        out.append((k, v))
    return out


@pytest.mark.exactness
def test_logits_after_eviction_match_reference_with_true_positions(arch_model):
    with epikv.attach(arch_model, "random", budget=24) as cache:
        tokens, _ = decode(arch_model, cache, PROMPT, 40)
        assert cache.stats()[0].evictions > 0
        kept = kept_states(cache)
        true_pos = int(cache.seen[0])
        compacted_len = cache.get_seq_length()
        nxt = torch.tensor([[tokens[-1]]])
        ours = arch_model(input_ids=nxt, **cache_kwargs(arch_model, cache), use_cache=True).logits[0, -1]
        # one token attends everything a plain cache holds: no mask (a hybrid takes one per layer kind)
        mask = {"full_attention": None, "sliding_attention": None} if cache.windows is not None else None

    def reference(position: int) -> torch.Tensor:
        ref = DynamicCache()
        for i, (k, v) in enumerate(kept):
            ref.update(k, v, i)
        pos = torch.tensor([[position]])
        return arch_model(
            input_ids=nxt,
            position_ids=pos,
            attention_mask=mask,
            **cache_kwargs(arch_model, ref),
            use_cache=True,
        ).logits[0, -1]

    assert compacted_len < true_pos
    torch.testing.assert_close(ours, reference(true_pos), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, reference(compacted_len), atol=1e-3), (
        "positions collapsed to compacted length"
    )


@pytest.mark.exactness
def test_kept_set_is_true_topk_of_recording_policy(tiny_llama):
    Recording.calls.clear()
    budget = 30
    policy = Recording(recent=5)
    with epikv.attach(tiny_llama, policy, budget=budget) as cache:
        logits = tiny_llama(input_ids=PROMPT, **cache_kwargs(tiny_llama, cache), use_cache=True).logits
        for _ in range(40):
            before = len(Recording.calls)
            token = logits[:, -1].argmax(-1, keepdim=True)
            logits = tiny_llama(input_ids=token, **cache_kwargs(tiny_llama, cache), use_cache=True).logits
            if len(Recording.calls) == before:
                continue
            pos, scores, _ = Recording.calls[-1]
            seen, prompt = int(cache.seen[0]), PROMPT.shape[1]
            forced = [p for p in pos[0].long().tolist() if p < prompt or p >= seen - 5]
            free = [
                (s, p)
                for s, p in zip(scores[0].tolist(), pos[0].long().tolist(), strict=True)
                if p not in forced
            ]
            best = [p for _, p in sorted(free, key=lambda sp: (-sp[0], -sp[1]))[: budget - len(forced)]]
            assert cache.layers[0].positions[0, 0].tolist() == sorted(forced + best)
    assert len(Recording.calls) > 10


def test_streaming_keeps_exactly_sinks_and_most_recent(tiny_llama):
    with epikv.attach(tiny_llama, "streaming", budget=20) as cache:
        decode(tiny_llama, cache, PROMPT, 1024)
        seen = int(cache.seen[0])
        for layer in cache.layers:
            assert layer.positions[0, 0].tolist() == [0, 1, 2, 3, *range(seen - 16, seen)]


def test_interval_bounds_growth(tiny_llama):
    with epikv.attach(tiny_llama, "random", budget=20, interval=8) as cache:
        lengths = []
        logits = tiny_llama(input_ids=PROMPT, **cache_kwargs(tiny_llama, cache), use_cache=True).logits
        for _ in range(60):
            logits = tiny_llama(
                input_ids=logits[:, -1].argmax(-1, keepdim=True),
                **cache_kwargs(tiny_llama, cache),
                use_cache=True,
            ).logits
            lengths.append(cache.get_seq_length())
    assert max(lengths) <= 28 and max(lengths) > 21  # grows between compactions, never past K + tau
    assert cache.compactions >= 5


@pytest.mark.exactness
def test_padded_batch_equals_each_prompt_alone(tiny_model, tok):
    prompts = ["the quick brown fox jumps", "hi", "a much longer prompt than the others here"]
    sampling = SamplingConfig(max_new_tokens=50, ignore_eos=True)
    for name in ["epikv-flat", "epikv", "streaming"]:
        params = {"band_a": 1, "band_b": 2} if name != "streaming" else {}
        batch = generate(tiny_model, tok, prompts, name, budget=60, sampling=sampling, interval=4, **params)
        for prompt, got in zip(prompts, batch, strict=True):
            alone = generate(
                tiny_model, tok, [prompt], name, budget=60, sampling=sampling, interval=4, **params
            )[0]
            assert got.token_ids == alone.token_ids, name
            assert (got.evictions, got.peak_cache_tokens, got.final_cache_tokens) == (
                alone.evictions,
                alone.peak_cache_tokens,
                alone.final_cache_tokens,
            )
        assert any(r.evictions > 0 for r in batch)


def test_counters(tiny_llama, tok):
    r = generate(
        tiny_llama,
        tok,
        ["hello there"],
        "random",
        budget=30,
        sampling=SamplingConfig(max_new_tokens=40, ignore_eos=True),
    )[0]
    assert r.prompt_tokens == 11 and r.tokens_generated == 40
    # the last token is sampled but never fed back: 11 + 39 tokens seen
    assert r.final_cache_tokens == 30 and r.evictions == 11 + 39 - 30
    assert r.peak_cache_tokens == 31


def test_budget_errors(tiny_llama):
    with pytest.raises(ValueError, match="budget must be a positive"):
        epikv.attach(tiny_llama, "random", budget=0)
    with pytest.raises(ValueError, match="needs a budget"):
        epikv.attach(tiny_llama, "random", budget=None)
    with epikv.attach(tiny_llama, "epikv-flat", budget=12, band_a=1, band_b=2) as cache:
        # K 12 cannot hold the prompt (10) and its recent window (3): the row runs at 13 (10 + 13 // 4)
        tiny_llama(input_ids=PROMPT, **cache_kwargs(tiny_llama, cache), use_cache=True)
        assert cache.books.budgets == [13] and cache.stats()[0].budget == 13


def test_unknown_policy_suggests():
    with pytest.raises(ValueError, match="did you mean 'epikv-flat'"):
        epikv.get_policy("epikv-flt")
    with pytest.raises(ValueError, match="unknown parameter"):
        epikv.get_policy("epikv-flat", bands=3)
    with pytest.raises(ValueError, match="window must be >= 2, got 1"):
        epikv.get_policy("epikv-flat", window=1)
