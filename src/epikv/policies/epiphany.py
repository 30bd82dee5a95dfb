"""Shared machinery of the EpiKV family: band layers and the frozen per-token epiphany score.

At each decode token t and band layer x in {A, B}: d_t = ||h_t - h_{t-1}||_2, z_t = causal rolling
z-score of d over the last ``window`` values (generation order, never pruned by eviction), and
s_t = z_A - z_B (band_mode ``diff``). s_t is frozen when computed and stored beside the token's
keys as the ``epiphany`` buffer (paper §1.3; method-and-baselines.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from epikv import scoring
from epikv.policies.base import Bands, ModelInfo, Needs, Policy, StepSignals
from epikv.policies.rows import RowState

BAND_MODES = ("diff", "a_only", "b_only")


@dataclass
class EpiphanyState(RowState):
    """Per-row state: previous band states (B, hidden), windows of step changes (B, W) and how many
    changes each row has seen (B,); ``extra`` holds a subclass's own per-row state."""

    win_a: torch.Tensor
    win_b: torch.Tensor
    count: torch.Tensor
    prev_a: torch.Tensor | None = None
    prev_b: torch.Tensor | None = None
    extra: Any = None


@dataclass(frozen=True)
class BandedPolicy(Policy[EpiphanyState]):
    """Base of policies scored by hidden-state change at two band layers.

    band_a, band_b: decoder layers (0-based; h = output of that layer); None = from the model's
    profile. window: rolling z-score window W. band_mode: diff | a_only | b_only.
    """

    requires = ("hidden_states",)
    uses_bands = True

    band_a: int | None = None
    band_b: int | None = None
    window: int = 64
    band_mode: str = "diff"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 2:
            raise ValueError(f"{self.name}: window must be >= 2, got {self.window}")
        if self.band_mode not in BAND_MODES:
            raise ValueError(f"{self.name}: band_mode must be one of {BAND_MODES}, got {self.band_mode!r}")
        for attr in ("band_a", "band_b"):
            value = getattr(self, attr)
            if value is not None and value < 0:
                raise ValueError(f"{self.name}: {attr} must be >= 0, got {value}")

    def resolve(self, model: ModelInfo, bands: Bands | None = None) -> BandedPolicy:
        """Bands set as parameters win; the others come from ``bands`` (the model's profile)."""
        a, b = self.band_a, self.band_b
        if a is None or b is None:
            if bands is None:
                raise ValueError(f"{self.name}: no band profile for {model.identity}; set band_a and band_b")
            a = bands.band_a if a is None else a
            b = bands.band_b if b is None else b
        for attr, value in (("band_a", a), ("band_b", b)):
            if value >= model.num_layers:
                raise ValueError(
                    f"{self.name}: {attr}={value} is outside the model's layers 0..{model.num_layers - 1}"
                )
        return replace(self, band_a=a, band_b=b)

    def needs(self) -> Needs:
        return Needs(hidden_layers=self._bands())

    def _bands(self) -> tuple[int, ...]:
        if self.band_a is None or self.band_b is None:
            raise ValueError(f"{self.name}: bands are unresolved; call resolve(model_info) first")
        return (self.band_a, self.band_b)

    def init_state(self, batch_size: int, model: ModelInfo, device: torch.device) -> EpiphanyState:
        zeros = torch.zeros(batch_size, self.window, device=device)
        count = torch.zeros(batch_size, dtype=torch.long, device=device)
        return EpiphanyState(win_a=zeros, win_b=zeros.clone(), count=count)

    def observe(self, state: EpiphanyState, step: StepSignals) -> dict[str, torch.Tensor]:
        a, b = self._bands()
        h_a, h_b = step.hidden[a], step.hidden[b]
        batch, q = step.valid.shape
        if step.prefill:
            # Left padding puts every row's last prompt token in the last column.
            state.prev_a, state.prev_b = h_a[:, -1].float(), h_b[:, -1].float()
            return {"epiphany": torch.zeros(1, batch, 1, q, device=h_a.device)}
        out = []
        for i in range(q):  # q is 1 in decoding
            out.append(self._push(state, h_a[:, i].float(), h_b[:, i].float()))
        return {"epiphany": torch.stack(out, dim=-1)[None, :, None, :]}

    def _push(self, state: EpiphanyState, h_a: torch.Tensor, h_b: torch.Tensor) -> torch.Tensor:
        d_a = (
            scoring.step_change(h_a, state.prev_a)
            if state.prev_a is not None
            else h_a.new_zeros(h_a.shape[0])
        )
        d_b = (
            scoring.step_change(h_b, state.prev_b)
            if state.prev_b is not None
            else h_b.new_zeros(h_b.shape[0])
        )
        state.prev_a, state.prev_b = h_a, h_b
        state.win_a = scoring.push_window(state.win_a, d_a)
        state.win_b = scoring.push_window(state.win_b, d_b)
        state.count = state.count + 1
        z_a = scoring.rolling_zscore(state.win_a, state.count)
        z_b = scoring.rolling_zscore(state.win_b, state.count)
        return scoring.epiphany_score(z_a, z_b, self.band_mode)
