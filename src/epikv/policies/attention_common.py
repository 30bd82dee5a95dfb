"""What the attention-based baselines share (H2O, TOVA, SnapKV, R-KV, RaaS, ThinKV).

This module owns four things: the per-row state (decode steps and ring writes per row, so rows
that joined the batch at different steps keep their own counts); the layers a baseline reads (all
of them unless set, filled from :class:`ModelInfo` by ``resolve``); lifting the per-layer attention
the cache delivers into the (G, B, H, ...) layout of scores and buffers; and the base of the
windowed policies (SnapKV, R-KV) with its *ring of per-token buffers* that keeps the rows of the
last w queries aligned with the cached slots through compactions.

Why a ring of buffers: the cache hands a policy, per step, the rows of the last ``attention_queries``
*new* tokens (w rows at prefill, one per decode step), while SnapKV and R-KV score with the rows of
the last w queries. Rows kept in the policy state would go stale at every compaction (slots move,
and the policy is never told the kept index); a running sum of the last w rows cannot be kept as one
buffer either, because dropping the oldest row needs that row. So row i of the window lives in its own
per-token buffer ``{prefix}{i}`` (ring slot i = the row's query number mod w): the cache gathers it
with the same keep index as the keys, a slot written after the query holds 0 (causality), an evicted
slot vanishes. At a compaction the w buffers are exactly the rows the last w queries produced,
restricted to the surviving slots. Cost: w buffers of (G, B, H, L) rewritten per step (each row
replaces its own ring slot and extends the others by zeros).

Attention rows of padding queries (left-padded prompts) are zeroed here with ``StepSignals.valid``.
It knows nothing of models or of the cache internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from epikv import scoring
from epikv.policies.base import CacheView, ModelInfo, Needs, Policy, StepSignals
from epikv.policies.rows import RowState


@dataclass
class AttentionState(RowState):
    """Per-row state: decode steps taken (B,), query rows written to the ring (B,), and a policy's
    own per-row state in ``extra``; the model's shape is shared by every row."""

    shared = ("model",)

    model: ModelInfo
    steps: torch.Tensor
    ring_count: torch.Tensor
    extra: Any = None


@dataclass(frozen=True)
class AttentionPolicy(Policy[AttentionState]):
    """Base of the baselines that read attention weights.

    layers: decoder layers whose attention is read; None = every layer (set by ``resolve``). Policies
    that select per layer need every layer.
    """

    requires = ("attention_weights",)

    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layers is not None:
            layers = tuple(sorted({int(x) for x in self.layers}))
            if not layers or layers[0] < 0:
                raise ValueError(f"{self.name}: layers must be non-negative layer indices, got {self.layers}")
            object.__setattr__(self, "layers", layers)

    def attention_rows(self) -> int:
        """Query rows per layer the policy reads from each step (the current query by default)."""
        return 1

    def default_layers(self, model: ModelInfo) -> tuple[int, ...]:
        return model.cache_layers

    def resolve(self, model: ModelInfo, bands: Any = None) -> AttentionPolicy:
        layers = self.layers if self.layers is not None else self.default_layers(model)
        if layers[-1] >= model.num_layers:
            raise ValueError(f"{self.name}: layers {layers} fall outside 0..{model.num_layers - 1}")
        sliding = [i for i in layers if i not in model.cache_layers]
        if sliding:
            raise ValueError(f"{self.name}: layers {sliding} have a sliding window and never evict")
        if "layer" in self.granularity and layers != model.cache_layers:
            raise ValueError(f"{self.name}: selects per layer and needs every layer, got layers={layers}")
        return self.with_params(layers=layers)

    def needs(self) -> Needs:
        return Needs(attention_layers=self.resolved_layers(), attention_queries=self.attention_rows())

    def resolved_layers(self) -> tuple[int, ...]:
        if self.layers is None:
            raise ValueError(f"{self.name}: layers are unresolved; call resolve(model_info) first")
        return self.layers

    def init_state(self, batch_size: int, model: ModelInfo, device: torch.device) -> AttentionState:
        zeros = torch.zeros(batch_size, dtype=torch.long, device=device)
        return AttentionState(model=model, steps=zeros, ring_count=zeros.clone())


@dataclass(frozen=True)
class WindowedAttentionPolicy(AttentionPolicy):
    """Base of the policies that score with the rows of the last ``window`` queries, pooled along the
    slots by ``kernel`` (SnapKV, R-KV), re-scored every ``interval`` steps; the rows live in a ring
    of per-token buffers named ``{ring}{i}``. ``fold`` is how query heads join their KV head."""

    granularity = "layer_head"
    ring: ClassVar[str] = ""
    fold: ClassVar[str] = "mean"

    interval: int = 128
    window: int = 32
    kernel: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"{self.name}: window must be >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"{self.name}: kernel must be a positive odd number, got {self.kernel}")

    def attention_rows(self) -> int:
        return self.window

    def observe(self, state: AttentionState, step: StepSignals) -> dict[str, torch.Tensor]:
        rows = valid_rows(step, stacked(step.attention, self.resolved_layers()))  # (G, B, Hq, w, L)
        folded_rows = folded(rows, state.model.num_kv_heads, self.fold)
        return ring_observe(state, step, folded_rows, self.ring, self.window)

    def window_rows(self, view: CacheView) -> torch.Tensor:
        """The ring's rows at a compaction, (window, G, B, H, L)."""
        return ring_rows(view.buffers, self.ring, self.window)


def stacked(signal: dict[int, torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor:
    """Per-layer attention (B, Hq, ...) stacked over ``layers`` into (G, B, Hq, ...) float32."""
    return torch.stack([signal[i].float() for i in layers])


def folded(x: torch.Tensor, num_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """(G, B, Hq, ...) -> (G, B, H, ...): query heads folded onto their KV head (see ``group_heads``)."""
    g, b = x.shape[:2]
    out = scoring.group_heads(x.reshape(g * b, *x.shape[2:]), num_kv_heads, how)
    return out.reshape(g, b, *out.shape[1:])


def valid_rows(step: StepSignals, rows: torch.Tensor) -> torch.Tensor:
    """Zero the rows (G, B, Hq, w, L) of padding queries: the last w new tokens' ``step.valid``."""
    w = rows.shape[3]
    return rows * step.valid[:, -w:].to(rows.dtype)[None, :, None, :, None]


def ring_observe(
    state: AttentionState, step: StepSignals, rows: torch.Tensor, prefix: str, size: int
) -> dict[str, torch.Tensor]:
    """Write the newest query rows (G, B, H, n, L_total) into a ring of ``size`` per-token buffers.

    In each row, ring slot (that row's query number mod size) is replaced by the query's attention
    row and every other slot is extended by zeros for this step's q new tokens (n <= size). Returns
    every buffer of the ring at full length, name -> (G, B, H, L_total).
    """
    g, b, h, n, _ = rows.shape
    q = step.valid.shape[1]
    target = (state.ring_count[:, None] + torch.arange(n, device=rows.device)[None, :]) % size  # (B, n)
    state.ring_count = state.ring_count + n
    out = {}
    for slot in range(size):  # the ring's w buffers, not tokens
        name = f"{prefix}{slot}"
        old = step.buffers.get(name)
        kept = rows.new_zeros(g, b, h, q) if old is None else torch.nn.functional.pad(old, (0, q))
        hit = (target == slot).to(rows.dtype)  # (B, n): at most one query of a row per slot
        written = torch.einsum("gbhnl,bn->gbhl", rows, hit)
        out[name] = torch.where(hit.sum(dim=1).bool()[None, :, None, None], written, kept)
    return out


def ring_rows(buffers: dict[str, torch.Tensor], prefix: str, size: int) -> torch.Tensor:
    """The ring's buffers stacked, (size, G, B, H, L); rows not yet written are all zero."""
    return torch.stack([buffers[f"{prefix}{slot}"] for slot in range(size)])
