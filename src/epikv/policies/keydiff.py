"""``keydiff``: KeyDiff, key-similarity eviction (arXiv 2504.15364).

Attention-free and query-free: each key scores minus its cosine similarity to the mean of the
L2-normalised cached keys of its layer and KV head, so the most distinctive keys are kept
(:func:`epikv.scoring.keydiff_scores`). Re-scored from the cache at every compaction, per layer and
KV head, every step once over budget. KeyDiff was proposed for block-wise prefill (kvpress applies it
at prefill); here it runs at decode under the shared rule (prompt kept, last r = min(128, K/4)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv import scoring
from epikv.policies.base import CacheView, Policy
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class KeyDiff(Policy):
    """Minus cosine similarity to the mean normalised key, per layer and KV head."""

    name = "keydiff"
    summary = "KeyDiff: keep the keys least similar to the mean normalised key, per KV head."
    source = "https://arxiv.org/abs/2504.15364"
    granularity = "layer_head"

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        return torch.stack([scoring.keydiff_scores(view.keys(layer), view.valid) for layer in view.layers])
