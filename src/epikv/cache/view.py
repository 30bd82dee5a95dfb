"""What policies and users read from a budgeted cache: the per-compaction view policies score from,
and the per-sequence counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv import scoring


@dataclass
class SequenceStats:
    """What the cache did to one sequence. ``mean_cache_tokens``: tokens held during a decode pass
    (after its new token), averaged over the passes since the prefill (None before the first).
    ``budget``: the K it ran at (raised for a prompt whose protected tokens pass the asked K:
    :meth:`~epikv.spec.CacheSpec.prompt_budget`; None: it never evicts)."""

    prompt_tokens: int
    tokens_seen: int
    peak_cache_tokens: int
    final_cache_tokens: int
    evictions: int
    mean_cache_tokens: float | None = None
    budget: int | None = None


class SlotView:
    """The read-only view policies score from (implements ``epikv.policies.base.CacheView``): some
    rows of the cache (all when ``rows`` is None) at one budget."""

    def __init__(self, cache: Any, rows: list[int] | None, budget: int) -> None:
        self._cache = cache
        self._rows = None if rows is None else torch.tensor(rows, device=cache.valid.device)
        self.budget = budget
        self.num_layers = len(cache.layers)
        self.layers: tuple[int, ...] = cache.model.cache_layers
        self.prompt_len = self._pick(cache.prompt_len)
        self.seen = self._pick(cache.seen)
        self.valid = self._pick(cache.valid)
        self.buffers = {name: self._pick(buf, dim=1) for name, buf in cache.buffers.items()}

    def _pick(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return x if self._rows is None else x.index_select(dim, self._rows)

    def keys(self, layer: int) -> torch.Tensor:
        return self._pick(self._cache.layers[layer].keys)

    def values(self, layer: int) -> torch.Tensor:
        return self._pick(self._cache.layers[layer].values)

    def key_variance(self, layer: int) -> torch.Tensor:
        return scoring.slot_variance(self.keys(layer))

    def positions(self, layer: int | None = None) -> torch.Tensor:
        layer = self.layers[0] if layer is None else layer
        return self._pick(self._cache.layers[layer].positions).long()

    def project_queries(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._cache.project_queries is None:
            raise RuntimeError("this cache is not attached to a model; queries cannot be recomputed")
        return self._cache.project_queries(layer, hidden, positions)
