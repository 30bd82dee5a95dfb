"""``epikv-seg``: EpiKV v2 (camera-ready) segment tiers without attention (repo name kv_seg_hs).

At a compaction, the slots before the recent window are cut into ``segment``-slot segments; each
segment is tiered by its mean cached-key variance (tertiles: R top third, E, T), tiers cap how many
generated tokens a segment keeps (64/32/8), segments are walked oldest first until the budget
K - r - P is spent, and inside a segment tokens are ranked by the epiphany score. With ``fill`` the
budget the caps leave unspent goes to the best remaining tokens globally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv import scoring
from epikv.policies.base import CacheView, global_scores
from epikv.policies.epiphany import BandedPolicy
from epikv.policies.registry import register


def mean_key_variance(view: CacheView) -> torch.Tensor:
    """Key variance over head_dim averaged over heads and every evicting layer, (B, L): one layer's
    variances at a time (the view reads keys in bounded pieces), never a whole layer's float64 keys."""
    first, *rest = view.layers
    total = view.key_variance(first).mean(dim=1)
    for layer in rest:
        total = total + view.key_variance(layer).mean(dim=1)
    return total / len(view.layers)


def tiered_priority(
    view: CacheView, within: torch.Tensor, caps: tuple[int, int, int], segment: int, recent: int, fill: bool
) -> torch.Tensor:
    """Seg's keep priority per slot, (B, L): +inf for tokens chosen by the tier caps, ``within`` for
    the rest when ``fill`` is on, else -inf. Prompt and recent slots are protected by the cache."""
    variance = mean_key_variance(view)
    positions = view.positions()[:, 0, :]
    out = torch.full_like(within, float("-inf"))
    for b in range(within.shape[0]):  # rows of a batch, at compaction only
        slots = view.valid[b].nonzero().squeeze(-1)
        classify = max(0, slots.numel() - recent)
        n_seg = (classify + segment - 1) // segment
        if n_seg == 0:
            continue
        idx = slots[:classify]
        stats = torch.stack([variance[b, idx[i * segment : (i + 1) * segment]].mean() for i in range(n_seg)])
        candidate = positions[b, idx] >= view.prompt_len[b]
        left = view.budget - recent - int(view.prompt_len[b])
        chosen = scoring.segment_keep(
            within[b, idx], candidate, scoring.segment_tiers(stats), caps, segment, left
        )
        row = out[b]
        if fill:
            row[idx] = within[b, idx]
        row[idx[chosen]] = float("inf")
    return out


@register
@dataclass(frozen=True)
class EpiKVSeg(BandedPolicy):
    """Key-variance segment tiers with in-segment ranking by the epiphany score (tau = 1 as in v2;
    the authors' later operating point is interval=128)."""

    name = "epikv-seg"
    summary = "EpiKV v2: key-variance segment tiers (caps 64/32/8), ranked by epiphany score."
    source = "https://arxiv.org/abs/2606.26472"

    segment: int = 128
    cap_r: int = 64
    cap_e: int = 32
    cap_t: int = 8
    fill: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.segment < 1:
            raise ValueError(f"{self.name}: segment must be >= 1, got {self.segment}")
        for attr in ("cap_r", "cap_e", "cap_t"):
            if getattr(self, attr) < 0:
                raise ValueError(f"{self.name}: {attr} must be >= 0, got {getattr(self, attr)}")

    @property
    def caps(self) -> tuple[int, int, int]:
        return (self.cap_r, self.cap_e, self.cap_t)

    def within_segment_score(self, state: Any, view: CacheView) -> torch.Tensor:
        return view.buffers["epiphany"][0, :, 0, :]

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        within = self.within_segment_score(state, view)
        recent = self.recent_window(view.budget)
        return global_scores(tiered_priority(view, within, self.caps, self.segment, recent, self.fill))
