"""Recent queries recomputed with vLLM's own modules (Seg-Q), never read from its attention kernel.

A layer's query is RoPE(q_norm(q_proj(input_norm(h)))) at the token's true position, with h the
residual stream entering the layer (the previous layer's output, which the policy keeps). vLLM fuses
q, k and v into one projection (``qkv_proj``) in every model type built here; the q slice is taken.
Which steps a model type has (its input norm, a query norm per head or over all heads) comes from the
one architecture table, :data:`epikv.archs.ARCHITECTURES`, that epikv's own engine reads too. The
rotary embedding is vLLM's module of that layer, so partial RoPE (Phi-3) and gpt-oss's half-width
tables need nothing here. On vLLM's Transformers backend (OLMo-2, Seed-OSS, OLMo-3, SmolLM3) the
modules are transformers' own, so after the fused projection the path is epikv's engine's
(:func:`epikv.querypath.shape_queries`: per-layer-kind tables and NoPE layers included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from epikv.archs import ARCHITECTURES

ATTENTION = {"gpt_oss": "attn"}
"""Where vLLM's decoder layer keeps its attention module, where not at ``self_attn``."""


def query_projector(model: Any, model_type: str) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``project(layer, hidden (B, W, hidden), positions (B, W)) -> (B, Hq, W, D)`` post-RoPE queries."""
    if type(model).__module__.startswith("vllm.model_executor.models.transformers"):
        return _transformers_backend(model, model_type)
    facts = ARCHITECTURES[model_type]
    layers = model.model.layers
    name = ATTENTION.get(model_type, "self_attn")

    def project(layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        decoder = layers[layer]
        attn = getattr(decoder, name)
        b, w, size = hidden.shape
        weight = attn.qkv_proj.weight
        with torch.no_grad():
            x = hidden.reshape(b * w, size).to(weight.dtype)
            if facts.input_norm is not None:
                x = getattr(decoder, facts.input_norm)(x)
            qkv, _ = attn.qkv_proj(x)
            q, k, _ = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            norm = getattr(attn, facts.q_norm, None) if facts.q_norm is not None else None
            if norm is not None and facts.q_norm_whole:
                q = norm(q)
            elif norm is not None:
                q = norm(q.reshape(b * w, -1, attn.head_dim)).reshape(q.shape)
            q, _ = attn.rotary_emb(positions.reshape(-1).long(), q.contiguous(), k.contiguous())
        return q.reshape(b, w, -1, attn.head_dim).transpose(1, 2)

    return project


def _transformers_backend(
    model: Any, model_type: str
) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]:
    """vLLM's Transformers backend runs transformers' own modules (``model.model``) with q, k and v
    fused into one ``qkv_proj``: its q slice, then epikv's engine's query path on those modules (the
    query norm, the model's rotary tables of the layer's kind, RoPE where the layer applies it)."""
    from epikv.querypath import rope_tables, shape_queries

    facts = ARCHITECTURES[model_type]
    inner = model.model

    def project(layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        decoder = inner.layers[layer]
        attn = decoder.self_attn
        fused = attn.qkv_proj
        with torch.no_grad():
            x = hidden.to(fused.weight.dtype)
            if facts.input_norm is not None:
                x = getattr(decoder, facts.input_norm)(x)
            qkv = fused(x)
            qkv = qkv[0] if isinstance(qkv, tuple) else qkv
            q = qkv[..., : fused.num_heads * fused.head_size]  # this rank's query heads
            cos, sin = rope_tables(inner, facts, layer, x, positions.long())
            return shape_queries(attn, facts, q, cos, sin)

    return project
