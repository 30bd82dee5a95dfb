"""Hooks, architecture checks and query recomputation against the model's own attention."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, GPT2Config, GPT2LMHeadModel, MistralForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import epikv
from epikv import scoring
from epikv.integration import active_hooks, attention_implementation, kernels, model_info, project_queries
from epikv.integration.arch import check_supported, decoder_layers
from epikv.integration.compat import cache_kwargs
from epikv.models.tiny import random_weights, tiny_config, tiny_model

PROMPT = torch.tensor([[5, 17, 3, 44, 8, 9, 21, 60, 2, 11, 13, 70, 4]])
RECORDED_QUERIES: dict[int, torch.Tensor] = {}


def _record_queries(module, query, *args, **kwargs):
    """SDPA that first keeps the query states the attention module computed (post norm and RoPE)."""
    RECORDED_QUERIES[module.layer_idx] = query.detach().clone()
    return sdpa_attention_forward(module, query, *args, **kwargs)


AttentionInterface.register("epikv-record-queries", _record_queries)


@pytest.mark.exactness
def test_hooks_removed_and_attention_untouched(tiny_model):
    assert active_hooks(tiny_model) == 0
    with epikv.attach(tiny_model, "epikv", budget=64, band_a=1, band_b=2) as cache:
        assert active_hooks(tiny_model) == 4  # pre + post on the stack, two band layers
        out = tiny_model(input_ids=PROMPT, **cache_kwargs(tiny_model, cache), use_cache=True)
        assert attention_implementation(tiny_model) == kernels.NAME  # SDPA, decode on packed groups
        assert getattr(out, "attentions", None) is None
    assert active_hooks(tiny_model) == 0
    assert attention_implementation(tiny_model) == "sdpa"  # the model's own setting is back
    with pytest.raises(RuntimeError), epikv.attach(tiny_model, "epikv-flat", budget=64, band_a=1, band_b=2):
        raise RuntimeError("boom")
    assert active_hooks(tiny_model) == 0


def test_hooks_ignore_other_caches(tiny_llama):
    ref = tiny_llama(input_ids=PROMPT, **cache_kwargs(tiny_llama, DynamicCache()), use_cache=True).logits
    with epikv.attach(tiny_llama, "epikv-flat", budget=64, band_a=1, band_b=2) as cache:
        other = tiny_llama(
            input_ids=PROMPT, **cache_kwargs(tiny_llama, DynamicCache()), use_cache=True
        ).logits
        assert not cache.started
    torch.testing.assert_close(ref, other)


def test_unsupported_models_are_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported"):
        epikv.attach(gpt2, "streaming", budget=32)
    mistral = MistralForCausalLM(tiny_config("mistral", sliding_window=64))
    with pytest.raises(ValueError, match="with a sliding window"):
        epikv.attach(mistral, "streaming", budget=32)
    phi3_mini = random_weights(tiny_config("phi3", sliding_window=2047))  # a supported type, windowed
    with pytest.raises(ValueError, match=r"'phi3' with a sliding window \(sliding_window=2047\)"):
        epikv.attach(phi3_mini, "streaming", budget=32)
    rescaled = random_weights(tiny_config("llama", num_hidden_layers=1))
    rescaled.model.layers[0].self_attn.scaling = 0.125  # head_dim 16: 1/sqrt(16) would be 0.25
    with pytest.raises(ValueError, match=r"scales queries by 0\.125, not 1/sqrt"):
        epikv.attach(rescaled, "streaming", budget=32)


@pytest.mark.parametrize(
    "arch, overrides, reason",
    [
        ("gemma2", {"head_dim": 16}, r"caps attention logits \(softcapping\)"),
        ("deepseek_v3", {"n_routed_experts": 2, "kv_lora_rank": 8, "q_lora_rank": 8}, "multi-head latent"),
        ("mamba", {}, "state-space or linear-attention layers"),
    ],
)
def test_known_architectures_are_refused_with_the_reason(arch, overrides, reason):
    config = tiny_config(arch, num_hidden_layers=2, **overrides)
    config._attn_implementation = "eager"  # gpt-oss has no SDPA path
    model = random_weights(config)
    with pytest.raises(ValueError, match=f"model type '{arch}' is not supported by epikv yet: it .*{reason}"):
        epikv.attach(model, "streaming", budget=32)


def test_hybrid_models_are_refused_where_the_windows_cannot_be_kept():
    every = tiny_model("gemma3_text", layer_types=["sliding_attention"] * 4)
    with pytest.raises(ValueError, match=r"sliding window in every layer .* no global layer to evict in"):
        epikv.attach(every, "streaming", budget=32)
    hybrid = tiny_model("gemma3_text")  # layers 0 and 2 slide
    with pytest.raises(ValueError, match=r"layers \[0\] have a sliding window and never evict"):
        epikv.attach(hybrid, "h2o", budget=32, layers=[0, 1])
    with pytest.raises(ValueError, match=r"query_layer=2 is a sliding-window layer"):
        epikv.attach(hybrid, "epikv", budget=32, query_layer=2)
    hybrid.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="cannot take the sliding-window mask"):
        epikv.attach(hybrid, "streaming", budget=32)


def test_band_outside_model(tiny_llama):
    with pytest.raises(ValueError, match=r"band_b=9 is outside the model's layers 0..3"):
        epikv.attach(tiny_llama, "epikv-flat", budget=64, band_a=1, band_b=9)
    # Band A on the last layer: the queries come from that layer itself (no layer A+1 exists)
    assert epikv.attach(tiny_llama, "epikv", budget=64, band_a=3, band_b=2).policy.query_layer == 3
    assert epikv.attach(tiny_llama, "epikv", budget=64, band_a=1, band_b=2).policy.needs().hidden_layers == (
        1,
        2,
    )
    with pytest.raises(ValueError, match="query_layer=9 is outside"):
        epikv.attach(tiny_llama, "epikv", budget=64, band_a=1, band_b=2, query_layer=9)


@pytest.mark.exactness
def test_recomputed_queries_reproduce_eager_attention(arch_model):
    """Seg-Q relevance from stored Band-A states equals the eager attention row of layer A+1 (a
    global layer: Seg-Q's queries meet keys that evict, never a sliding window's)."""
    band_a = next(i for i in model_info(arch_model).cache_layers if i >= 2) - 1
    eager = copy.deepcopy(arch_model)
    eager.config._attn_implementation = "eager"
    cache = DynamicCache()
    captured = {}
    handle = eager.model.layers[band_a].register_forward_hook(lambda m, a, o: captured.update(h=o))
    try:
        out = eager(input_ids=PROMPT, **cache_kwargs(eager, cache), use_cache=True, output_attentions=True)
    finally:
        handle.remove()
    n = PROMPT.shape[1]
    last = torch.tensor([[n - 1]])
    q = project_queries(
        arch_model, epikv.integration.check_supported(arch_model), band_a + 1, captured["h"][:, -1:], last
    )
    keys = cache.layers[band_a + 1].keys
    rel = scoring.qk_relevance(q, keys, last, torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))
    heads = out.attentions[band_a + 1][:, :, -1, :]
    # gpt-oss's learned sinks take a share of each head's row; Seg-Q ranks over the keys alone
    want = (heads / heads.sum(dim=-1, keepdim=True)).mean(dim=1)
    torch.testing.assert_close(rel, want, rtol=1e-4, atol=1e-5)


def test_model_info(tiny_llama):
    info = model_info(tiny_llama)
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (4, 4, 2, 16)
    assert info.identity == "tiny-llama"


@pytest.mark.exactness
def test_recomputed_queries_are_the_models_own(arch_model):
    """Queries recomputed from the residual entering each layer, at given (true) positions, equal the
    query states that layer's attention computed there: projection (fused or not), query norm
    (per head or over all heads), partial or full RoPE."""
    model = copy.deepcopy(arch_model)
    model.config._attn_implementation = "epikv-record-queries"
    entering: dict[int, torch.Tensor] = {}
    layers = decoder_layers(model)

    def keep(index: int):
        return lambda m, args, kwargs: entering.update(
            {index: kwargs.get("hidden_states", args[0] if args else None)}
        )

    handles = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    positions = torch.arange(PROMPT.shape[1])[None] + 1000  # not 0..n-1: the positions given are used
    RECORDED_QUERIES.clear()
    try:
        model(input_ids=PROMPT, position_ids=positions, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    spec = check_supported(model)
    assert sorted(RECORDED_QUERIES) == list(range(len(layers)))
    for index in range(len(layers)):
        ours = project_queries(model, spec, index, entering[index], positions)
        torch.testing.assert_close(ours, RECORDED_QUERIES[index], rtol=1e-5, atol=1e-6)


def test_prefill_signals_own_only_the_last_row(tiny_llama):
    """At prefill the band states handed to the policy are the last prompt row in storage of their
    own: a view would hold each band layer's whole (B, P, hidden) output through the forward and in
    the policy's state (measured on an H200: +2 x P x hidden x 2 B at peak, 2 GiB at 128k on 8B)."""
    prompt = torch.arange(1, 49)[None]
    seen = []
    with epikv.attach(tiny_llama, "epikv", budget=64, band_a=1, band_b=2) as cache:
        end_step = cache.end_step
        cache.end_step = lambda signals: (seen.append(signals), end_step(signals))[1]
        tiny_llama(input_ids=prompt, **cache_kwargs(tiny_llama, cache), use_cache=True)
    assert seen and seen[0].prefill and sorted(seen[0].hidden) == [1, 2]
    for h in seen[0].hidden.values():
        assert h.shape[:2] == (1, 1)
        assert h.untyped_storage().nbytes() == h.numel() * h.element_size()
    for kept in (cache.state.prev_a, cache.state.prev_b):  # what the policy keeps to the next step
        assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
