"""``snapkv``: decode-time SnapKV (Li et al., NeurIPS 2024, arXiv 2404.14469).

SnapKV scores each cached token by the attention the last w "observation window" queries give it,
summed over the window, smoothed along the positions by a 1-D pool (kernel 5, average), and keeps
the top tokens per KV head. The original compresses the prompt once after prefill; this is the decode
form (R-KV's SnapKV baseline, kvpress ``DecodingPress``): the whole cache is re-scored every
``interval`` decode steps with the window of the last w queries.

Window handling (works for any interval, tau = 1 included): the rows of the last w queries live in a
ring of w per-token buffers (see :mod:`epikv.policies.attention_common`), filled with the last w
prompt rows at prefill and one row per decode step. At a compaction the ring holds exactly the rows
those w queries produced, restricted to the surviving slots. Each row is the attention of its query
over the cache of its own step: with interval >= w (the default 128 vs 32) nothing was evicted within
the window, so this equals the window's attention over the current cache; with interval < w a row's
mass on tokens evicted since is gone, not renormalised (the observed attention, as SnapKV reads it).

Defaults: w = 32 (official config), kernel 5, avg pool, interval 128 (R-KV's decode SnapKV); per
layer and KV head, query heads of a group averaged (kvpress). Protection: the shared rule (prompt kept,
last r = min(128, K/4) >= w at K >= 128) where the original keeps only the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv import scoring
from epikv.policies.attention_common import WindowedAttentionPolicy
from epikv.policies.base import CacheView
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class SnapKV(WindowedAttentionPolicy):
    """Pooled attention of the last w queries, per layer and KV head, re-scored every interval steps."""

    name = "snapkv"
    summary = "SnapKV at decode time: last-32-query attention, avg-pooled (5), per KV head, every 128 steps."
    source = "https://arxiv.org/abs/2404.14469"
    ring = "snapkv"
    fold = "mean"

    pooling: str = "avg"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"{self.name}: pooling must be 'avg' or 'max', got {self.pooling!r}")

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        window_sum = self.window_rows(view).sum(dim=0)  # (G, B, H, L)
        window_sum = window_sum.masked_fill(~view.valid[None, :, None, :], 0.0)  # holes hold copies
        return scoring.pool_slots(window_sum, self.kernel, self.pooling)
