"""The differences between the transformers releases epikv supports (5.19, which vLLM 0.32 pins,
to 5.24), each decided by feature, never by version string: a name that moved, a helper that is
missing. Everything else in epikv calls these instead of guessing which release it runs on."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn


def local_pack_gqa(hidden_states: torch.Tensor | None, n_rep: int) -> torch.Tensor | None:
    """(B, Hq, 1, D) -> (B, H, n_rep, D), Hq = H * n_rep; a mask shared by all heads (B, 1, 1, L)
    or None is returned as is. transformers' own ``pack_gqa`` (5.23 on), for the releases
    before it; ``tests/test_compat.py`` proves the two equal where both exist."""
    if hidden_states is None or hidden_states.shape[1] == 1:
        return hidden_states
    batch, num_attention_heads, _, dim = hidden_states.shape
    return hidden_states.reshape(batch, num_attention_heads // n_rep, n_rep, dim)


try:
    from transformers.integrations.sdpa_attention import pack_gqa
except ImportError:  # transformers before 5.23 (vLLM 0.32 pins 5.19)
    pack_gqa = local_pack_gqa


@functools.cache
def _cache_keyword(forward_owner: type) -> str:
    parameters = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_keyword(model: nn.Module) -> str:
    """The keyword under which ``model``'s forward and ``generate`` take a cache: ``cache`` where the
    forward names it so (transformers 5.24; ``past_key_values`` is deprecated there and warns), else
    ``past_key_values`` (5.19 to 5.23: there ``generate`` refuses ``cache=`` and the forward ignores it)."""
    return _cache_keyword(type(model))


def cache_kwargs(model: nn.Module, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(..., **cache_kwargs(model, cache))`` on either release."""
    return {cache_keyword(model): cache}
