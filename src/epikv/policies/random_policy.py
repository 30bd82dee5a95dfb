"""``random``: seeded uniform scores under EpiKV's protection rules; the null baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epikv.policies.base import CacheView, ModelInfo, Policy
from epikv.policies.registry import register
from epikv.policies.rows import RowState


@dataclass
class RandomState(RowState):
    """One generator per row, so a row draws the same numbers whatever batch it runs in."""

    generators: list[torch.Generator]


def draw(state: RandomState, valid: torch.Tensor, groups: int = 1, heads: int = 1) -> torch.Tensor:
    """Uniform scores (groups, B, heads, L) for the real slots of ``valid`` (B, L), -inf at holes;
    row r draws groups x heads x (its real slots) numbers from its own generator, in that order."""
    noise = torch.full((groups, valid.shape[0], heads, valid.shape[1]), float("-inf"))
    real = valid.cpu()
    for row, generator in enumerate(state.generators):  # rows of a batch, at compaction only
        noise[:, row][..., real[row]] = torch.rand(groups, heads, int(real[row].sum()), generator=generator)
    return noise.to(valid.device)


@register
@dataclass(frozen=True)
class RandomEviction(Policy[RandomState]):
    """Prompt and the last r tokens kept (as EpiKV); the rest ranked by seeded random numbers."""

    name = "random"
    summary = "Seeded random eviction with EpiKV's protection rules (null baseline)."
    source = ""

    seed: int = 0

    def init_state(self, batch_size: int, model: ModelInfo, device: torch.device) -> RandomState:
        return RandomState([torch.Generator(device="cpu").manual_seed(self.seed) for _ in range(batch_size)])

    def score(self, state: RandomState, view: CacheView) -> torch.Tensor:
        return draw(state, view.valid)
