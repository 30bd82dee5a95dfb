"""The transformers-release differences (epikv.integration.compat): each fallback gives what
transformers' own code gives wherever both exist, and the cache keyword is the model's own."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations import sdpa_attention

import epikv
from epikv.integration import compat, kernels
from epikv.integration.compat import cache_keyword, cache_kwargs, local_pack_gqa

pytestmark = pytest.mark.exactness  # also run under vLLM's transformers (README's test command)

PROMPT = torch.tensor([[5, 17, 3, 44, 8, 9, 21, 60, 2, 11, 13, 70]])


def packable(batch: int = 3, kv_heads: int = 2, groups: int = 4, length: int = 9, dim: int = 8):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(batch, kv_heads * groups, 1, dim, generator=gen)
    key = torch.randn(batch, kv_heads, length, dim, generator=gen)
    value = torch.randn(batch, kv_heads, length, dim, generator=gen)
    mask = torch.rand(batch, 1, 1, length, generator=gen) > 0.3
    mask[..., -1] = True  # every row sees at least its own token
    return query, key, value, mask, groups


@pytest.mark.skipif(
    not hasattr(sdpa_attention, "pack_gqa"), reason="this transformers has no pack_gqa to compare with"
)
def test_local_pack_gqa_equals_transformers_own():
    query, _, _, mask, groups = packable()
    ours, theirs = local_pack_gqa(query, groups), sdpa_attention.pack_gqa(query, groups)
    assert ours is not None and theirs is not None
    assert torch.equal(ours, theirs) and ours.stride() == theirs.stride()
    assert local_pack_gqa(mask, groups) is mask and sdpa_attention.pack_gqa(mask, groups) is mask
    assert local_pack_gqa(None, groups) is None and sdpa_attention.pack_gqa(None, groups) is None


def test_the_fallback_is_chosen_by_feature():
    expected = getattr(sdpa_attention, "pack_gqa", local_pack_gqa)
    assert compat.pack_gqa is expected


@pytest.mark.parametrize("pack", [local_pack_gqa, getattr(sdpa_attention, "pack_gqa", None)])
def test_a_packed_decode_step_equals_repeated_heads(pack, monkeypatch):
    """Either pack (ours always; transformers' where it has one) gives the attention of repeated K/V."""
    if pack is None:
        pytest.skip("this transformers has no pack_gqa")
    monkeypatch.setattr(kernels, "pack_gqa", pack)
    query, key, value, mask, groups = packable()
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    module.is_causal = True
    out, _ = kernels.packed_decode_sdpa(module, query, key, value, mask, scaling=0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query,
        key.repeat_interleave(groups, dim=1),
        value.repeat_interleave(groups, dim=1),
        attn_mask=mask,
        scale=0.5,
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_cache_keyword_is_the_forwards_own(tiny_llama):
    keyword = cache_keyword(tiny_llama)
    assert keyword in inspect.signature(type(tiny_llama).forward).parameters
    assert keyword in {"cache", "past_key_values"}


def test_the_cache_reaches_the_model_without_a_deprecation_warning(tiny_llama):
    ref = tiny_llama.generate(
        PROMPT, max_new_tokens=6, do_sample=False, **cache_kwargs(tiny_llama, DynamicCache())
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with epikv.attach(tiny_llama, "full") as cache:
            out = tiny_llama.generate(
                PROMPT, max_new_tokens=6, do_sample=False, **cache_kwargs(tiny_llama, cache)
            )
    assert torch.equal(out, ref)
    assert cache.stats()[0].prompt_tokens == PROMPT.shape[1]  # the budgeted cache, not a new one, ran
