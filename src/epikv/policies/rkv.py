"""``rkv``: R-KV, redundancy-aware KV eviction for reasoning models (Cai et al., arXiv 2505.24133).

Every ``interval`` = 128 decode steps the cache is compressed back to the budget. Per layer and KV
head, with the last alpha = 8 queries as the observation window:

* importance I_j: each of the alpha rows, softmaxed over the *past* slots (the window's own slots
  excluded), averaged over the rows, then max-pooled along the slots (kernel 7);
* redundancy R_j: :func:`epikv.scoring.key_redundancy` (cosine similarity of normalised keys, the
  newest near-duplicate above 0.5 exempted, mean over rows, softmax);
* Z_j = lambda * I_j - (1 - lambda) * R_j, lambda = 0.1 (paper and README; the code default is 0.07);
  the last alpha slots are kept (+inf), the rest compete on Z.

The alpha rows come from a ring of per-token buffers (see :mod:`epikv.policies.attention_common`);
each is renormalised over the surviving past slots, which is exactly the softmax restricted to them.
Differs from R-KV: R-KV takes the max over a GQA group of the *logits* before the softmax; only
probabilities reach a policy here, so the max over the group is taken of each head's probabilities.
R-KV compresses the whole cache; here the shared rule also keeps the prompt and the last
r = min(128, K/4) tokens (a superset of R-KV's alpha window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv import scoring
from epikv.policies.attention_common import WindowedAttentionPolicy
from epikv.policies.base import CacheView
from epikv.policies.registry import register


def window_importance(rows: torch.Tensor, past: torch.Tensor, kernel: int) -> torch.Tensor:
    """R-KV importance from the window's rows (R, B, H, L) over the ``past`` (B, L) slots: each written
    row renormalised over the past, averaged over written rows, max-pooled. Returns (B, H, L)."""
    rows = rows * past[None, :, None, :]
    mass = rows.sum(dim=-1, keepdim=True)
    written = (mass > 0).float()
    mean = (rows / mass.clamp_min(1e-30)).sum(dim=0) / written.sum(dim=0).clamp_min(1.0)
    return scoring.pool_slots(mean, kernel, "max")


@register
@dataclass(frozen=True)
class RKV(WindowedAttentionPolicy):
    """lambda * importance (last 8 queries, max-pool 7) - (1 - lambda) * key redundancy, every 128 steps."""

    name = "rkv"
    summary = "R-KV: recent-query importance minus key redundancy, per KV head, every 128 steps."
    source = "https://arxiv.org/abs/2505.24133"
    ring = "rkv"
    fold = "max"

    window: int = 8
    kernel: int = 7
    threshold: float = 0.5
    mix_lambda: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not -1 <= self.threshold <= 1:
            raise ValueError(f"{self.name}: threshold must be a cosine in [-1, 1], got {self.threshold}")
        if not 0 <= self.mix_lambda <= 1:
            raise ValueError(f"{self.name}: mix_lambda must be in [0, 1], got {self.mix_lambda}")

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        rows = self.window_rows(view)  # (R, G, B, H, L)
        length = view.valid.shape[-1]
        in_window = torch.arange(length, device=view.valid.device) >= length - self.window
        past = view.valid & ~in_window
        out = []
        for g, layer in enumerate(view.layers):  # one L x L similarity matrix in memory at a time
            importance = window_importance(rows[:, g], past, self.kernel)
            redundancy = scoring.key_redundancy(view.keys(layer), view.valid, self.threshold)
            z = self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy
            out.append(z.masked_fill(in_window, float("inf")))
        return torch.stack(out)
