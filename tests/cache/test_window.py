"""Models with sliding-window layers (Gemma 3, OLMo-3, gpt-oss, EXAONE 4): global layers evict, each
window is a ring the model's own window semantics hold over, by true position."""

from __future__ import annotations

import pytest
import torch

import epikv
from epikv.engine.runner import Runner
from epikv.integration import build_spec, model_info
from epikv.integration.compat import cache_kwargs
from epikv.models.tiny import tiny_model

pytestmark = pytest.mark.exactness  # also run under vLLM's transformers (README's test command)

HYBRIDS = ("gemma3_text", "olmo3", "gpt_oss", "exaone4", "smollm3")
WINDOWED = {
    "smollm3": dict(
        use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2
    )
}


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request) -> torch.nn.Module:
    return tiny_model(request.param, **WINDOWED.get(request.param, {}))


def test_tiny_hybrids_have_windows_shorter_than_the_tests(hybrid):
    info = model_info(hybrid)
    assert info.sliding_layers == (0, 2) and info.cache_layers == (1, 3) and info.window == 6


def padded_pair(high: int, seed: int, pads: int, new_tokens: int) -> tuple[torch.Tensor, dict]:
    """Two prompts of 11 tokens, the second left-padded by ``pads``, and greedy generate's kwargs."""
    ids = torch.randint(3, high, (2, 11), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :pads] = 0
    return ids, dict(
        attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )


def test_full_equals_plain_transformers_past_the_window_in_a_padded_batch(hybrid):
    """Two rows of different prompt lengths (left padding), 40 new tokens, window 6: every ring turns
    over several times, and the tokens are those of transformers' own hybrid cache."""
    ids, kwargs = padded_pair(97, seed=3, pads=4, new_tokens=40)
    ref = hybrid.generate(ids, **kwargs)
    with epikv.attach(hybrid, "full") as cache:
        out = hybrid.generate(ids, **cache_kwargs(hybrid, cache), **kwargs)
    assert torch.equal(out, ref)


def test_a_ring_holds_exactly_the_last_window(hybrid):
    window = model_info(hybrid).window
    with epikv.attach(hybrid, "streaming", budget=12) as cache:
        logits = hybrid(
            input_ids=torch.tensor([[5, 17, 3, 44, 8, 9, 21, 60, 2, 11]]), **cache_kwargs(hybrid, cache)
        ).logits
        for _ in range(15):
            token = logits[:, -1].argmax(-1, keepdim=True)
            logits = hybrid(input_ids=token, **cache_kwargs(hybrid, cache)).logits
            ring = cache.windows.arena
            held = sorted(int(p) for p, v in zip(ring.positions[0, 0, 0], ring.valid[0], strict=True) if v)
            seen = int(cache.seen[0])
            assert held == list(range(seen - window, seen))
            assert ring.keys[0].shape[2] == window + 1  # W slots and one that padding writes to
    assert cache.stats()[0].evictions > 0


def test_a_prompt_in_chunks_equals_one_pass(hybrid):
    """A prompt longer than the window prefilled in chunks of 4 (the ring as it was, then each chunk's
    own tokens, masked by position) gives the one-pass logits and the same next tokens."""
    prompt = torch.randint(3, 97, (1, 15), generator=torch.Generator().manual_seed(5))
    spec = build_spec(hybrid, "full")
    outs = []
    for chunk in (4, 64):
        runner = Runner(hybrid, spec, prefill_chunk=chunk)
        cache = runner.new_cache()
        with runner.attachment:
            logits = runner.prefill(cache, prompt[0].tolist())
            tokens = []
            for _ in range(10):
                token = logits.reshape(-1).argmax().view(1, 1)
                tokens.append(int(token))
                logits = hybrid(input_ids=token, **cache_kwargs(hybrid, cache)).logits[:, -1]
        outs.append((logits, tokens))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    assert outs[0][1] == outs[1][1]


def test_only_global_layers_evict_and_sliding_layers_keep_their_window(hybrid):
    with epikv.attach(hybrid, "epikv", budget=16, interval=4) as cache:
        logits = hybrid(
            input_ids=torch.tensor([[5, 17, 3, 44, 8, 9, 21, 60, 2, 11]]), **cache_kwargs(hybrid, cache)
        ).logits
        for _ in range(30):
            logits = hybrid(
                input_ids=logits[:, -1].argmax(-1, keepdim=True), **cache_kwargs(hybrid, cache)
            ).logits
        stats = cache.stats()[0]
        assert stats.evictions > 0 and stats.peak_cache_tokens <= 16 + 4
        for i in model_info(hybrid).cache_layers:
            assert cache.layers[i].keys.shape[2] <= 16 + 4
        for i in model_info(hybrid).sliding_layers:
            assert cache.layers[i].keys.shape[2] == model_info(hybrid).window + 1


def test_gemma3_multimodal_wrapper_evicts_in_its_text_model():
    """Gemma 3 4B-27B load as Gemma3ForConditionalGeneration: the hooks sit on its base model, whose
    forward takes our masks; the layers are its language model's. Text prompts only (no images)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from epikv.models.tiny import tiny_spec

    text = {k: v for k, v in tiny_spec("gemma3_text").items() if k != "model_type"}
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
    )
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    ids, kwargs = padded_pair(90, seed=1, pads=3, new_tokens=30)
    ref = model.generate(ids, **kwargs)
    with epikv.attach(model, "full") as cache:
        assert torch.equal(model.generate(ids, **cache_kwargs(model, cache), **kwargs), ref)
    with epikv.attach(model, "streaming", budget=12) as cache:
        model.generate(ids, **cache_kwargs(model, cache), **kwargs)
    assert all(s.evictions > 0 and s.peak_cache_tokens <= 13 for s in cache.stats())
