"""``random-head``: random eviction drawn separately per layer and KV head, the prompt kept.

The second equal-memory baseline of Random Attention (arXiv 2609.03430, 2026), which finds that it
ties or beats SnapKV, R-KV and TriAttention on reasoning models at equal K: each layer's each KV
head keeps its own seeded random set (``random`` keeps one set for the whole model). Same
protection as every policy here (prompt and the recent window r = min(128, K/4)); one generator per
row, so a row draws the same numbers whatever batch it runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epikv.policies.base import CacheView
from epikv.policies.random_policy import RandomEviction, RandomState, draw
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class RandomPerHead(RandomEviction):
    """Prompt and the last r tokens kept; the rest ranked by seeded random numbers per KV head."""

    name = "random-head"
    summary = "Seeded random eviction drawn per layer and KV head, prompt kept (equal-memory baseline)."
    source = "https://arxiv.org/abs/2609.03430"
    granularity = "layer_head"

    def score(self, state: RandomState, view: CacheView) -> torch.Tensor:
        heads = view.positions().shape[1]  # (B, H, L): every KV head of the model at this granularity
        return draw(state, view.valid, len(view.layers), heads)
