"""``h2o`` and ``h2o-head``: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv 2306.14048).

A token's score is the attention it has received, accumulated over every query so far (prompt
queries included): S_j = sum_t A[t, j]. The sum lives in a replace-style per-token buffer ``h2o``:
each step the old sums are extended by zeros for the new tokens and this step's column sums
(``StepSignals.attention_colsum``, all new queries' rows summed) are added. An evicted token's sum
leaves with it; survivors keep theirs. Granularity is a class property, hence two names:

* ``h2o``: the EpiKV authors' harness — one mask for the whole model, the accumulated attention
  averaged over layers and query heads; 4 sinks + recent window r = min(128, K/4) (128 at the paper's
  budgets) + top heavy hitters; the prompt is not protected beyond the sinks.
* ``h2o-head``: the original — each layer and KV head keeps its own heavy hitters (with GQA the query
  heads of a group share a KV head, so their sums are averaged; the original ran MHA models); the
  budget split half recent, half heavy (the official scripts' equal heavy/recent ratios), no sinks,
  no prompt protection.

Both evict every step once over budget (interval 1), as the paper does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv.policies.attention_common import AttentionPolicy, AttentionState, folded, stacked
from epikv.policies.base import CacheView, StepSignals
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class H2O(AttentionPolicy):
    """H2O as run in the EpiKV harness: accumulated attention, mean over layers and heads, one mask;
    4 sinks + last r kept."""

    name = "h2o"
    summary = "H2O heavy hitters (accumulated attention), one global mask, 4 sinks + recent window."
    source = "https://arxiv.org/abs/2306.14048"

    protect_prompt: bool = False
    n_sink: int = 4

    def accumulated(self, state: AttentionState, step: StepSignals) -> torch.Tensor:
        """This step's column sums in the buffer layout: (1, B, 1, L) mean over layers and heads."""
        return stacked(step.attention_colsum, self.resolved_layers()).mean(dim=(0, 2))[None, :, None]

    def observe(self, state: Any, step: StepSignals) -> dict[str, torch.Tensor]:
        new = self.accumulated(state, step)
        old = step.buffers.get("h2o")
        if old is not None:
            new = new + torch.nn.functional.pad(old, (0, new.shape[-1] - old.shape[-1]))
        return {"h2o": new}

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        return view.buffers["h2o"]


@register
@dataclass(frozen=True)
class H2OHead(H2O):
    """H2O as published: per layer and KV head, half the budget recent, half heavy hitters.

    recent_ratio: share of the budget kept as the recent window when ``recent`` is None (H2O's
    recent ratio over its heavy + recent budget).
    """

    name = "h2o-head"
    summary = "H2O heavy hitters per layer and KV head, budget split half recent / half heavy (original)."
    granularity = "layer_head"

    n_sink: int = 0
    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.recent_ratio < 1:
            raise ValueError(f"{self.name}: recent_ratio must be in [0, 1), got {self.recent_ratio}")

    def recent_window(self, budget: int) -> int:
        return self.recent if self.recent is not None else int(budget * self.recent_ratio)

    def accumulated(self, state: AttentionState, step: StepSignals) -> torch.Tensor:
        """(G, B, H, L): per layer, query heads averaged onto their KV head."""
        colsum = stacked(step.attention_colsum, self.resolved_layers())
        return folded(colsum, state.model.num_kv_heads, "mean")
