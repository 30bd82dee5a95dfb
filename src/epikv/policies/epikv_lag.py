"""``epikv-lag``: EpiKV's lag-normalised key/value variant (arXiv 2606.26472; repo name lag_kv).

A causal adaptation of LagKV (Liang et al., arXiv 2504.04704): keys and values averaged over layers,
cut into ``lag``-slot chunks, each chunk min-max normalised per head and channel against the
*previous* chunk (the first chunk is left as is), per-token std over head_dim, mean over heads,
score = key spread + value spread. Re-scored from the cache at every eviction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv import scoring
from epikv.policies.base import CacheView, Policy, global_scores
from epikv.policies.registry import register


def layer_mean(view: CacheView, which: str) -> torch.Tensor:
    """Mean over layers of the cached keys or values, (B, H, L, D), one layer in memory at a time."""
    get = view.keys if which == "keys" else view.values
    first, *rest = view.layers
    total = get(first).float().clone()
    for layer in rest:
        total += get(layer).float()
    return total / len(view.layers)


@register
@dataclass(frozen=True)
class EpiKVLag(Policy[None]):
    """Prompt and last r kept; generated tokens ranked by lag-normalised K+V spread (keys only if
    ``use_values`` is False, the repo's lag_kv_key)."""

    name = "epikv-lag"
    summary = "EpiKV's lag-normalised key/value spread (causal, previous-chunk reference)."
    source = "https://arxiv.org/abs/2606.26472"

    lag: int = 128
    use_values: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lag < 2:
            raise ValueError(f"{self.name}: lag must be >= 2, got {self.lag}")

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        means = [layer_mean(view, "keys")] + ([layer_mean(view, "values")] if self.use_values else [])
        out = torch.full(view.valid.shape, float("-inf"), device=view.valid.device)
        holes = (~view.valid).sum(dim=-1).tolist()  # holes are a prefix of each row
        for row, start in enumerate(holes):  # rows of a batch, at compaction only
            # Chunks are counted from the row's first real slot, so a row scores the same in any batch.
            spreads = [scoring.lag_normalized_spread(x[row : row + 1, :, start:], self.lag) for x in means]
            out[row, start:] = sum(s.mean(dim=1)[0] for s in spreads)
        return global_scores(out)
