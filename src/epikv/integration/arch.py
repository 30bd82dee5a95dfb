"""Per-architecture facts and the few transformers internals the hooks read.

The table (:mod:`epikv.archs`) says which model types are supported and how their queries are made;
everything that reaches into a model's modules (layers, rotary embedding, query projection) is here or
in the sibling modules of this package, nowhere else in epikv.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from epikv.archs import ARCHITECTURES, NOT_YET, ArchFacts, window_problem
from epikv.policies.base import ModelInfo
from epikv.querypath import rope_tables, shape_queries, text_config, text_model


def check_supported(model: nn.Module) -> ArchFacts:
    """The architecture's spec, or a clear error for models the cache would get silently wrong."""
    config = text_config(model)
    model_type = getattr(config, "model_type", None)
    if model_type in NOT_YET:
        raise ValueError(f"model type {model_type!r} is not supported by epikv yet: it {NOT_YET[model_type]}")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"model type {model_type!r} is not supported by epikv "
            f"(supported: {', '.join(sorted(ARCHITECTURES))}); "
            "eviction needs RoPE attention in global (not sliding-window) layers"
        )
    spec = ARCHITECTURES[model_type]
    problem = window_problem(config, model_type)
    if problem is not None:
        raise ValueError(problem)
    if getattr(text_model(model), "rotary_emb", None) is None:
        raise ValueError(f"model type {model_type!r} has no rotary embedding; true positions cannot be kept")
    attn = decoder_layers(model)[0].self_attn
    scaling = getattr(attn, "scaling", None)
    if scaling is not None and not math.isclose(scaling, attn.head_dim**-0.5, rel_tol=1e-6):
        raise ValueError(
            f"model type {model_type!r} scales queries by {scaling}, not 1/sqrt(head_dim); "
            "the recomputed attention rows would be wrong"
        )
    return spec


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return text_model(model).layers


def model_info(model: nn.Module) -> ModelInfo:
    from epikv.models.identity import model_identity

    return ModelInfo.from_config(text_config(model), model_identity(model))


def attention_queries(
    attn: nn.Module, spec: ArchFacts, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The queries attention module ``attn`` computes from its input ``x`` (B, W, hidden), with
    RoPE tables ``cos, sin`` (B, W, R): projection, the architecture's query norm, RoPE.
    Returns (B, Hq, W, head_dim). The one owner of the query path (Seg-Q and attention capture)."""
    q = getattr(attn, spec.q_proj)(x)
    if spec.fused_qkv:
        q = q[..., : attn.config.num_attention_heads * attn.head_dim]
    return shape_queries(attn, spec, q, cos, sin)


def project_queries(
    model: nn.Module, spec: ArchFacts, layer: int, hidden: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Queries of ``layer`` for residual states ``hidden`` (B, W, hidden) entering it, with RoPE at
    ``positions`` (B, W): the layer's own input norm (where it has one), then
    :func:`attention_queries`. Returns (B, Hq, W, head_dim)."""
    decoder = decoder_layers(model)[layer]
    attn = decoder.self_attn
    with torch.no_grad():
        x = hidden.to(getattr(attn, spec.q_proj).weight.dtype)
        if spec.input_norm is not None:
            x = getattr(decoder, spec.input_norm)(x)
        cos, sin = rope_tables(model, spec, layer, x, positions)
        return attention_queries(attn, spec, x, cos, sin)
