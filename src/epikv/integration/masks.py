"""The attention masks of a model with sliding-window layers, while a budgeted cache is attached.

Such a model (Gemma 3, OLMo-3, gpt-oss, EXAONE 4) builds one mask per layer kind, and its window
mask counts slots as positions, which a cache whose sliding layers keep a ring
(:mod:`epikv.cache.window`) and whose global layers compact does not satisfy. So the hooks hand the
model both masks ready-made (the ``{layer kind: mask}`` mapping these models accept in place of a 2D
mask), built by transformers' own mask function for the attention implementation in use:

* ``full_attention``: the global layers' slots, causal in slot order (a row's tokens are in
  positional order in its slots), holes masked;
* ``sliding_attention``: the ring (and a prompt pass's own tokens), each key seen by a query when it
  is real, not after the query and within its window, by true position.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

from epikv.querypath import text_config

MASKED = ("sdpa", "eager", "epikv_sdpa")
"""Attention implementations whose masks are materialised (flash attention takes only padding)."""


def check_implementation(model: nn.Module) -> None:
    impl = str(text_config(model)._attn_implementation)
    if impl not in MASKED:
        raise ValueError(
            f"attention implementation {impl!r} cannot take the sliding-window mask of a budgeted cache "
            f"(its rings are masked by true position); load the model with one of {MASKED[:2]}"
        )


def hybrid_masks(model: nn.Module, cache: Any, positions: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Both layer kinds' masks for the pass whose new tokens sit at true ``positions`` (B, q); the
    cache has already chosen their slots (``begin_step``)."""
    config = text_config(model)
    interface = ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]
    batch, q = positions.shape
    windows, width = cache.windows, cache.width
    common: dict[str, Any] = dict(
        batch_size=batch,
        q_length=q,
        kv_offset=0,
        dtype=next(model.parameters()).dtype,
        config=config,
        use_vmap=False,
        device=positions.device,
    )
    full = interface(
        kv_length=width,
        q_offset=width - q,
        mask_function=causal_mask_function,
        attention_mask=cache.valid if cache.has_holes else None,
        allow_is_causal_skip=True,
        **common,
    )
    sliding = interface(
        kv_length=windows.key_positions.shape[-1],
        q_offset=0,
        mask_function=windows.mask_function(positions),
        attention_mask=None,
        allow_is_causal_skip=False,
        **common,
    )
    return {"full_attention": full, "sliding_attention": sliding}
