"""The query path both hosts share, host-neutral (torch and :mod:`epikv.archs` only, no transformers
import): from a layer's projected queries to what attention receives (the architecture's query
norm, the head split, RoPE with the model's own tables). epikv's engine
(:mod:`epikv.integration.arch`) and the vLLM plugin's Transformers-backend path
(:mod:`epikv.vllm.queries`) both call it, so the plugin never loads :mod:`epikv.integration`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epikv.archs import ArchFacts


def text_config(model: nn.Module) -> Any:
    return model.config.get_text_config(decoder=True)


def base_model(model: nn.Module) -> nn.Module:
    return getattr(model, getattr(model, "base_model_prefix", "model"), model)


def text_model(model: nn.Module) -> nn.Module:
    """The decoder stack: the base model, or its ``language_model`` in a multimodal wrapper (Gemma 3
    4B-27B), whose own forward hands the stack its masks (the hooks stay on the base model)."""
    base = base_model(model)
    return getattr(base, "language_model", base)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on queries (B, H, W, D) with the model's tables (B, W, R): the first R <= D dims of each
    head rotate (R < D is partial RoPE: Phi-3, GLM-4.5), the rest pass; the result keeps q's dtype."""
    cos, sin = cos[:, None], sin[:, None]
    rotated, passed = q[..., : cos.shape[-1]], q[..., cos.shape[-1] :]
    return torch.cat([rotated * cos + rotate_half(rotated) * sin, passed], dim=-1).to(q.dtype)


def shape_queries(
    attn: nn.Module, spec: ArchFacts, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Projected queries ``q`` (B, W, Hq*head_dim) of attention module ``attn`` made what attention
    receives: the architecture's query norm, the head split, RoPE (where the layer applies it).
    Returns (B, Hq, W, head_dim). Also the query path of vLLM's Transformers backend, whose modules
    are transformers' own but for a fused projection (:mod:`epikv.vllm.queries`)."""
    norm = getattr(attn, spec.q_norm, None) if spec.q_norm is not None else None
    if norm is not None and spec.q_norm_whole:
        q = norm(q)
    q = q.view(*q.shape[:2], -1, attn.head_dim)
    if norm is not None and not spec.q_norm_whole:
        q = norm(q)
    if not rotates(attn, spec):
        return q.transpose(1, 2)
    if spec.half_tables:  # gpt-oss rotates (first half, second half): rotate_half's layout, tables twice
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return apply_rope(q.transpose(1, 2), cos, sin)


def rotates(attn: nn.Module, spec: ArchFacts) -> bool:
    """Whether attention module ``attn`` applies RoPE (SmolLM3's and EXAONE 4's NoPE layers do not)."""
    if spec.rope_flag is not None:
        return bool(getattr(attn, spec.rope_flag))
    if spec.nope_global:
        return attn.sliding_window is None or bool(attn.is_sliding)
    return True


def rope_tables(
    model: nn.Module, spec: ArchFacts, layer: int, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables ``layer`` uses at ``positions`` (its layer kind's own, where tables differ)."""
    rotary = text_model(model).rotary_emb
    if spec.rope_by_layer_type:
        return rotary(x, positions, text_config(model).layer_types[layer])
    return rotary(x, positions)
