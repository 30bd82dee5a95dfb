"""``epikv-flat``: EpiKV v1/v2 headline policy (arXiv 2606.26472; repo name hs_variance_detrend)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv.policies.base import CacheView
from epikv.policies.epiphany import BandedPolicy
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class EpiKVFlat(BandedPolicy):
    """Prompt and last r = min(128, K/4) kept; the other generated tokens ranked by the frozen
    epiphany score s = z_A - z_B; evicts every step once over budget (one mask for all layers/heads).
    """

    name = "epikv-flat"
    summary = "EpiKV v1: detrended hidden-state change, Band A minus Band B."
    source = "https://arxiv.org/abs/2606.26472"

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        return view.buffers["epiphany"]
