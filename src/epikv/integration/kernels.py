"""The attention function a model runs while a budgeted cache is attached: transformers' SDPA, with
one-token steps always on packed query groups.

transformers' ``sdpa`` reads grouped-query K/V without repeating them in two ways: ``enable_gqa``
(when there is no mask) or *packing* a single query's groups into the query-length dimension
(``pack_gqa``, when there is a mask). On the CPU the first is several times slower for a decode step
(bf16 x6 at 2,048 cached tokens here: ``docs/benchmarks.md``), and a batch flips between the two
as rows of different lengths come and go. So while attached, a one-token step always packs;
everything else (prefill, chunks, softcap, position bias) goes to transformers' own function.
Registered under its own name through transformers' public attention and mask interfaces, and
switched to only for the duration of an attachment (the model's own setting is restored after).

``pack_gqa`` comes from :mod:`epikv.integration.compat` (transformers' own where it has one; 5.19 has
none, so the same reshape there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from epikv.integration.compat import pack_gqa

NAME = "epikv_sdpa"


def packed_decode_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query (B, Hq, q, D), key/value (B, H, L, D); returns (B, q, Hq, D) as transformers' SDPA does."""
    groups = query.shape[1] // key.shape[1]
    plain = kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
    if query.shape[2] != 1 or groups == 1 or plain:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        pack_gqa(query, groups),
        key,
        value,
        attn_mask=pack_gqa(attention_mask, groups),
        dropout_p=dropout,
        scale=scaling,
    )
    return out.reshape(out.shape[0], -1, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the function and its (SDPA) mask format under :data:`NAME`; idempotent."""
    AttentionInterface.register(NAME, packed_decode_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME
