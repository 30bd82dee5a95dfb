"""Recent queries recomputed with vLLM's own modules (Seg-Q), never read from its attention kernel.

For the Llama family (``config.QUERY_MODELS``): a layer's query is RoPE(q_proj(input_norm(h))) at the
token's true position, with h the residual stream entering the layer (the previous layer's output,
which the policy keeps). vLLM fuses q, k and v into one projection; the q slice is taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def query_projector(model: Any) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``project(layer, hidden (B, W, hidden), positions (B, W)) -> (B, Hq, W, D)`` post-RoPE queries."""
    layers = model.model.layers

    def project(layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        decoder = layers[layer]
        attn = decoder.self_attn
        b, w, size = hidden.shape
        weight = attn.qkv_proj.weight
        with torch.no_grad():
            x = decoder.input_layernorm(hidden.reshape(b * w, size).to(weight.dtype))
            qkv, _ = attn.qkv_proj(x)
            q, k, _ = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, _ = attn.rotary_emb(positions.reshape(-1).long(), q.contiguous(), k.contiguous())
        return q.reshape(b, w, attn.num_heads, attn.head_dim).transpose(1, 2)

    return project
