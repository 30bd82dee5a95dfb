"""Per-architecture facts and the few transformers internals the hooks read.

The table says which model types are supported and where their parts live; everything that
reaches into a model's modules (layers, rotary embedding, query projection) is here or in the
sibling modules of this package, nowhere else in epikv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epikv.policies.base import ModelInfo


@dataclass(frozen=True)
class ArchSpec:
    """Where an architecture keeps what the hooks need."""

    q_norm: str | None = None  # per-head query norm applied before RoPE (Qwen3)


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "mistral": ArchSpec(),
    "qwen2": ArchSpec(),
    "qwen3": ArchSpec(q_norm="q_norm"),
}


def text_config(model: nn.Module) -> Any:
    return model.config.get_text_config(decoder=True)


def check_supported(model: nn.Module) -> ArchSpec:
    """The architecture's spec, or a clear error for models the cache would get silently wrong."""
    config = text_config(model)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"model type {model_type!r} is not supported by epikv "
            f"(supported: {', '.join(sorted(ARCHITECTURES))}); "
            "eviction needs RoPE attention without sliding windows"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layer_types)
    window = getattr(config, "sliding_window", None)
    if sliding or (window is not None and getattr(config, "use_sliding_window", True)):
        raise ValueError(
            f"model type {model_type!r} with sliding-window layers (sliding_window={window}) "
            "is not supported: "
            "a window over compacted slots would mask the wrong tokens"
        )
    if getattr(base_model(model), "rotary_emb", None) is None:
        raise ValueError(f"model type {model_type!r} has no rotary embedding; true positions cannot be kept")
    return ARCHITECTURES[model_type]


def base_model(model: nn.Module) -> nn.Module:
    return getattr(model, getattr(model, "base_model_prefix", "model"), model)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return base_model(model).layers


def model_info(model: nn.Module) -> ModelInfo:
    from epikv.models.identity import model_identity

    config = text_config(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelInfo(
        identity=model_identity(model),
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        context_length=getattr(config, "max_position_embeddings", None),
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def project_queries(
    model: nn.Module, spec: ArchSpec, layer: int, hidden: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Queries of ``layer`` for residual states ``hidden`` (B, W, hidden) entering it, with RoPE at
    ``positions`` (B, W): the layer's own input norm, query projection (and Qwen3's q_norm), then
    RoPE. Returns (B, Hq, W, head_dim)."""
    decoder = decoder_layers(model)[layer]
    attn = decoder.self_attn
    info = model_info(model)
    with torch.no_grad():
        x = decoder.input_layernorm(hidden.to(attn.q_proj.weight.dtype))
        q = attn.q_proj(x).view(*hidden.shape[:2], -1, info.head_dim)
        if spec.q_norm is not None:
            q = getattr(attn, spec.q_norm)(q)
        q = q.transpose(1, 2)
        cos, sin = base_model(model).rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]
        return q * cos + rotate_half(q) * sin
