"""``tova``: Token Omission Via Attention (Oren et al., arXiv 2401.06104).

Each layer ranks its cached tokens by the attention of the *current* query (the newest token),
averaged over all query heads, and drops the lowest once the cache is over budget — every step, no
history. Per layer, heads shared, as in the paper. The current row is kept as a replace-style
per-token buffer ``tova`` (G, B, 1, L), rewritten every step, so it is aligned with the slots
whatever the interval.

Differs from the paper: the original protects nothing (kvpress keeps the newest token); here the
shared rule applies — prompt kept and the last r = min(128, K/4) tokens — so that TOVA's signal is
compared with EpiKV's under the same protection (``protect_prompt=False, recent=0`` gives the paper's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv.policies.attention_common import AttentionPolicy, stacked, valid_rows
from epikv.policies.base import CacheView, StepSignals
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class TOVA(AttentionPolicy):
    """Current query's attention averaged over heads, per layer; evicts every step."""

    name = "tova"
    summary = "TOVA: current query's attention (head mean), per layer, every step."
    source = "https://arxiv.org/abs/2401.06104"
    granularity = "layer"

    def observe(self, state: Any, step: StepSignals) -> dict[str, torch.Tensor]:
        rows = valid_rows(step, stacked(step.attention, self.resolved_layers()))  # (G, B, Hq, w, L)
        return {"tova": rows[:, :, :, -1].mean(dim=2, keepdim=True)}

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        return view.buffers["tova"]
