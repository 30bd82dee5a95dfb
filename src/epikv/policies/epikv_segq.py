"""``epikv-segq`` (alias ``epikv``): EpiKV v3, Seg tiers ranked by recent-query relevance.

Repo name kv_seg_hs_fill_tau128steps_qk_w8rep. The Band-A states of the last w decode tokens are
kept (the output of layer A = the input of layer A+1); at a compaction they are projected through
layer A+1's own input norm, query projection and RoPE at their true positions, dotted with layer
A+1's cached keys, softmaxed over the slots (causal) and averaged over queries and heads. The
z-scored relevance *replaces* the epiphany score inside the tiers (the shipped form), or is added to
it (``mode="add"``: z(s) + lambda * z(rel)). Fill on, tau = 128. No attention weights are read from
the model's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from epikv import scoring
from epikv.policies.base import Bands, CacheView, ModelInfo, Needs, StepSignals
from epikv.policies.epikv_seg import EpiKVSeg
from epikv.policies.epiphany import EpiphanyState
from epikv.policies.registry import register
from epikv.policies.rows import RowState

MODES = ("replace", "add")


@dataclass
class RecentStates(RowState):
    """The last w decode tokens' query-layer inputs per row, oldest first: hidden (B, w, hidden),
    positions (B, w), and how many of the w are real (B,) (a row that decoded fewer holds zeros)."""

    hidden: torch.Tensor
    positions: torch.Tensor
    count: torch.Tensor


@register
@dataclass(frozen=True)
class EpiKVSegQ(EpiKVSeg):
    """EpiKV v3: Seg tiers + recent-query q.K relevance (w = 8), fill, tau = 128."""

    name = "epikv-segq"
    summary = "EpiKV v3 (default): Seg tiers ranked by recent-query relevance, budget fill."
    source = "https://arxiv.org/abs/2606.26472"

    requires = ("hidden_states", "recent_queries")

    interval: int = 128
    first_compaction: str = "after_interval"  # the authors' harness: tau counts from the prefill
    fill: bool = True
    query_window: int = 8
    mode: str = "replace"
    weight: float = 1.0
    query_layer: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.query_window < 1:
            raise ValueError(f"{self.name}: query_window must be >= 1, got {self.query_window}")
        if self.mode not in MODES:
            raise ValueError(f"{self.name}: mode must be one of {MODES}, got {self.mode!r}")
        if self.query_layer is not None and self.query_layer < 1:
            raise ValueError(
                f"{self.name}: query_layer must be >= 1 (its input is layer query_layer-1's output), "
                f"got {self.query_layer}"
            )

    def resolve(self, model: ModelInfo, bands: Bands | None = None) -> EpiKVSegQ:
        """Bands from the profile; queries at layer A+1 (the paper), or at A itself when Band A is the
        model's last layer (a calibrated profile can put it there). On a model with sliding-window
        layers the queries must meet keys that evict: the first global layer from A+1 on (or the
        last global layer before it)."""
        resolved = super().resolve(model, bands)
        layer = self.query_layer
        if layer is None:
            layer = min(resolved.band_a + 1, model.num_layers - 1)
            later = [i for i in model.cache_layers if i >= max(layer, 1)]
            layer = later[0] if later else max(model.cache_layers)
        if layer >= model.num_layers:
            raise ValueError(
                f"{self.name}: query_layer={layer} is outside the model's layers 1..{model.num_layers - 1}"
            )
        if layer not in model.cache_layers:
            raise ValueError(
                f"{self.name}: query_layer={layer} is a sliding-window layer; its keys never evict "
                f"(global layers: {list(model.cache_layers)})"
            )
        return replace(resolved, query_layer=layer)

    @property
    def source_layer(self) -> int:
        """Layer whose output states (= the query layer's input) are kept for the recent queries."""
        if self.query_layer is None:
            raise ValueError(f"{self.name}: query_layer is unresolved; call resolve(model_info) first")
        return self.query_layer - 1

    def needs(self) -> Needs:
        layers = tuple(dict.fromkeys((*self._bands(), self.source_layer)))
        return Needs(hidden_layers=layers, query_layer=self.query_layer)

    def init_state(self, batch_size: int, model: ModelInfo, device: torch.device) -> EpiphanyState:
        state = super().init_state(batch_size, model, device)
        hidden = torch.zeros(batch_size, self.query_window, model.hidden_size, device=device)
        positions = torch.zeros(batch_size, self.query_window, dtype=torch.long, device=device)
        state.extra = RecentStates(hidden, positions, torch.zeros_like(state.count))
        return state

    def observe(self, state: EpiphanyState, step: StepSignals) -> dict[str, torch.Tensor]:
        out = super().observe(state, step)
        if not step.prefill:
            recent: RecentStates = state.extra
            new = step.hidden[self.source_layer]
            q = new.shape[1]
            recent.hidden = torch.cat([recent.hidden, new.to(recent.hidden.dtype)], dim=1)[
                :, -self.query_window :
            ]
            recent.positions = torch.cat([recent.positions, step.positions], dim=1)[:, -self.query_window :]
            recent.count = (recent.count + q).clamp(max=self.query_window)
        return out

    def within_segment_score(self, state: EpiphanyState, view: CacheView) -> torch.Tensor:
        recent: RecentStates = state.extra
        decode = view.valid & (view.positions()[:, 0, :] >= view.prompt_len[:, None])
        z_s = scoring.masked_zscore(view.buffers["epiphany"][0, :, 0, :], decode)
        if not bool((recent.count > 0).any()):  # one host sync per compaction
            return z_s
        layer = self.query_layer
        w = self.query_window
        query_valid = torch.arange(w, device=recent.count.device)[None, :] >= (w - recent.count)[:, None]
        queries = view.project_queries(layer, recent.hidden, recent.positions)
        key_positions = view.positions(layer)[:, 0, :]
        rel = scoring.qk_relevance(
            queries, view.keys(layer), recent.positions, key_positions, view.valid, query_valid
        )
        z_rel = scoring.masked_zscore(rel, decode)
        # A row that has not decoded yet (compacted right after its prefill) has no recent queries.
        if self.mode == "replace":
            return torch.where((recent.count > 0)[:, None], z_rel, z_s)
        return z_s + self.weight * z_rel
