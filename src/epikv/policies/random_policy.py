"""``random``: seeded uniform scores under EpiKV's protection rules; the null baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv.policies.base import CacheView, ModelInfo, Policy, global_scores
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class RandomEviction(Policy):
    """Prompt and the last r tokens kept (as EpiKV); the rest ranked by seeded random numbers."""

    name = "random"
    summary = "Seeded random eviction with EpiKV's protection rules (null baseline)."
    source = ""

    seed: int = 0

    def init_state(self, batch_size: int, model: ModelInfo, device: torch.device) -> Any:
        return torch.Generator(device="cpu").manual_seed(self.seed)

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        noise = torch.rand(view.valid.shape, generator=state).to(view.valid.device)
        return global_scores(noise)
