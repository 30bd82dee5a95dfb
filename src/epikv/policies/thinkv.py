"""``thinkv``: ThinKV's thought tiers and progressive retention, without quantization.

ThinKV (Ramachandran et al., ICLR 2026, arXiv 2510.01290) classifies stretches of a reasoning trace
into thought types by attention sparsity — Reasoning, Execution, Transition, importance R >> E >> T —
quantises them at different precisions and progressively evicts tokens of less important thoughts,
never dropping a thought segment entirely. **Its code is not public**; this is our reading of the
paper's description (method-and-baselines.md §2.6), eviction only (no quantization, no paged kernel).

What is implemented, and every assumption (A1-A9):

* A1 Segments are ``segment`` = 128 consecutive generated tokens, by generation order.
* A2 A token's sparsity is the share of its own query's attention weights below 1% of the row max
  (:func:`epikv.scoring.attention_sparsity`), averaged over query heads and the classifier layers; a
  segment's statistic is the mean over its tokens (the paper computes sparsity "from the key
  perspective"; we use each token's own attention row, the one the cache delivers).
* A3 Classifier layers: the last 4 layers (the paper uses 4 layers; which ones is not stated).
* A4 Thresholds: the paper fits them offline by KDE on calibration data; we fit a Gaussian KDE
  (Silverman's robust bandwidth) to the statistics of this generation's segments at every compaction
  (every tau = 128 steps, the paper's refresh) and cut at its two deepest minima; with fewer than two
  minima, tertiles. All segments, the current partial one included, are (re)classified each time.
* A5 Direction: the densest attention (lowest sparsity) is Reasoning, the sparsest Transition.
* A6 Eviction is triggered by the budget (K), not by thought transitions; each compaction lowers the
  retention level of segments, least important first (T before E before R, within a tier the least
  reduced and then oldest first), one step of the schedule 64 -> 32 -> 16 -> 8 -> 4 at a time, until
  the candidates fit K minus the protected tokens. A segment never goes below 4.
* A7 Representatives: K-means (deterministic evenly spaced init, 10 Lloyd iterations) on the
  post-RoPE keys of the classifier layers, heads and layers concatenated; the member nearest each
  centroid is kept (an empty cluster keeps nothing, so a segment may keep fewer than its cap).
* A8 One mask for the whole model (global granularity); tokens not kept are dropped (-inf), so the
  cache may hold fewer than K tokens after a compaction, as ThinKV frees slots. If the caps at level 4
  still exceed the budget, the least important representatives (T, oldest) go first.
* A9 Protection: the shared rule (prompt kept, last r = min(128, K/4) tokens, mostly the current
  segment).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from epikv import scoring
from epikv.policies.attention_common import AttentionPolicy, AttentionState, stacked
from epikv.policies.base import CacheView, ModelInfo, StepSignals, global_scores
from epikv.policies.registry import register
from epikv.policies.rows import RowState, pad_last


def kde_thresholds(values: torch.Tensor, grid: int = 256) -> tuple[float, float] | None:
    """The two deepest interior minima of a Gaussian KDE of ``values`` (S,), Silverman's robust
    bandwidth 0.9 * min(std, IQR / 1.34) * S^(-1/5), on a ``grid``-point grid; None if fewer than two."""
    v = values.float()
    if v.numel() < 3:
        return None
    std = float(v.std())
    iqr = float(v.quantile(0.75) - v.quantile(0.25))
    spread = min(std, iqr / 1.34) if iqr > 0 else std
    if spread <= 0:
        return None
    h = 0.9 * spread * v.numel() ** -0.2
    xs = torch.linspace(float(v.min()), float(v.max()), grid, device=v.device)
    density = torch.exp(-0.5 * ((xs[:, None] - v[None, :]) / h) ** 2).sum(dim=1)
    inner = density[1:-1]
    minima = ((inner < density[:-2]) & (inner <= density[2:])).nonzero().squeeze(-1) + 1
    if minima.numel() < 2:
        return None
    deepest = minima[density[minima].argsort()[:2]].sort().values
    return float(xs[deepest[0]]), float(xs[deepest[1]])


def thought_tiers(sparsity: torch.Tensor) -> torch.Tensor:
    """Thought tier of each segment from its sparsity (S,): 0 = Reasoning (densest), 1 = Execution,
    2 = Transition (sparsest); KDE thresholds, tertiles when the density has fewer than two minima."""
    cuts = kde_thresholds(sparsity)
    if cuts is None:
        return scoring.segment_tiers(-sparsity.float())
    low, high = cuts
    return (sparsity >= low).long() + (sparsity >= high).long()


def kmeans_representatives(x: torch.Tensor, k: int, iters: int = 10) -> torch.Tensor:
    """Indices (sorted, <= k) of the members nearest each K-means centroid of points x (n, F).

    Deterministic: centroids start at k evenly spaced points; an empty cluster keeps its centroid and
    contributes no representative. All points when n <= k."""
    n = x.shape[0]
    if n <= k:
        return torch.arange(n, device=x.device)
    x = x.float()
    centroids = x[torch.linspace(0, n - 1, k, device=x.device).round().long()]
    for _ in range(iters):
        assign = torch.cdist(x, centroids).argmin(dim=1)
        total = torch.zeros_like(centroids).index_add_(0, assign, x)
        count = torch.zeros(k, device=x.device).index_add_(0, assign, torch.ones(n, device=x.device))
        centroids = torch.where(count[:, None] > 0, total / count.clamp_min(1)[:, None], centroids)
    dist = torch.cdist(x, centroids)
    assign = dist.argmin(dim=1)
    member = assign[:, None] == torch.arange(k, device=x.device)[None, :]
    nearest = dist.masked_fill(~member, float("inf")).argmin(dim=0)
    return nearest[member.any(dim=0)].sort().values


def plan_levels(
    counts: list[int], tiers: list[int], levels: list[int], schedule: tuple[int, ...], room: int
) -> list[int]:
    """Lower segments' retention levels until their kept tokens fit ``room`` (A6). Level 0 keeps a
    segment whole, level i keeps at most schedule[i - 1]. Returns the new levels."""
    levels = list(levels)

    def kept() -> int:
        return sum(min(c, schedule[lv - 1]) if lv else c for c, lv in zip(counts, levels, strict=True))

    while kept() > room:
        open_ = [s for s in range(len(counts)) if levels[s] < len(schedule) and counts[s] > 0]
        if not open_:
            break
        s = min(open_, key=lambda i: (-tiers[i], levels[i], i))
        levels[s] += 1
    return levels


@dataclass
class ThoughtStats(RowState):
    """Per-row ThinKV bookkeeping, keyed by segment (never by slot, so compactions leave it valid):
    sparsity sums and token counts (B, S), decode steps per row (host-side, so growing S needs no
    device sync), retention levels per row and segment."""

    prompt_len: torch.Tensor
    sums: torch.Tensor
    counts: torch.Tensor
    steps: list[int]
    levels: list[list[int]]

    @classmethod
    def cat(cls, states: Sequence[ThoughtStats]) -> ThoughtStats:
        """Rows stacked; segment columns zero-padded to the widest (a zero count = no such segment)."""
        width = max(s.sums.shape[1] for s in states)
        padded = [replace(s, sums=pad_last(s.sums, width), counts=pad_last(s.counts, width)) for s in states]
        return super().cat(padded)


@register
@dataclass(frozen=True)
class ThinKV(AttentionPolicy):
    """Thought tiers from attention sparsity; progressive per-segment retention 64/32/16/8/4 by K-means
    representatives; eviction only. Original code not public — assumptions A1-A9 in the module doc."""

    name = "thinkv"
    summary = "ThinKV (our reading, no quantization): sparsity thought tiers, progressive K-means retention."
    source = "https://arxiv.org/abs/2510.01290"

    interval: int = 128
    segment: int = 128
    classifier_layers: int = 4
    sparsity_threshold: float = 0.01
    schedule: tuple[int, ...] = (64, 32, 16, 8, 4)
    kmeans_iters: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "schedule", tuple(int(x) for x in self.schedule))
        if self.segment < 1:
            raise ValueError(f"{self.name}: segment must be >= 1, got {self.segment}")
        if self.classifier_layers < 1:
            raise ValueError(f"{self.name}: classifier_layers must be >= 1, got {self.classifier_layers}")
        if not 0 < self.sparsity_threshold < 1:
            raise ValueError(
                f"{self.name}: sparsity_threshold must be in (0, 1), got {self.sparsity_threshold}"
            )
        s = self.schedule
        if not s or s[-1] < 1 or any(a <= b for a, b in itertools.pairwise(s)):
            raise ValueError(f"{self.name}: schedule must be strictly decreasing positive counts, got {s}")
        if self.kmeans_iters < 0:
            raise ValueError(f"{self.name}: kmeans_iters must be >= 0, got {self.kmeans_iters}")

    def default_layers(self, model: ModelInfo) -> tuple[int, ...]:
        return model.cache_layers[-self.classifier_layers :]

    def init_state(self, batch_size: int, model: ModelInfo, device: torch.device) -> AttentionState:
        state = super().init_state(batch_size, model, device)
        empty = torch.zeros(batch_size, 0, device=device)
        prompt_len = torch.zeros(batch_size, dtype=torch.long, device=device)
        steps = [0] * batch_size
        state.extra = ThoughtStats(prompt_len, empty, empty.clone(), steps, [[] for _ in range(batch_size)])
        return state

    def observe(self, state: AttentionState, step: StepSignals) -> dict[str, torch.Tensor]:
        stats: ThoughtStats = state.extra
        if step.prefill:
            stats.prompt_len = stats.prompt_len + step.valid.sum(dim=-1)  # a long prompt: in chunks
            return {}
        rows = stacked(step.attention, self.resolved_layers())[:, :, :, -1]  # (G, B, Hq, L)
        sparsity = scoring.attention_sparsity(rows, self.sparsity_threshold).mean(dim=(0, 2))  # (B,)
        segments = [s // self.segment for s in stats.steps]  # each row's own segment
        width = max(segments) + 1
        if width > stats.sums.shape[1]:
            stats.sums, stats.counts = pad_last(stats.sums, width), pad_last(stats.counts, width)
        seg = torch.tensor(segments, device=sparsity.device)[:, None]
        stats.sums = stats.sums.scatter_add(1, seg, sparsity[:, None])
        stats.counts = stats.counts.scatter_add(1, seg, torch.ones_like(sparsity)[:, None])
        q = step.valid.shape[1]
        stats.steps = [s + q for s in stats.steps]
        return {}

    def score(self, state: AttentionState, view: CacheView) -> torch.Tensor:
        stats: ThoughtStats = state.extra
        positions = view.positions()[:, 0, :]
        out = torch.full(positions.shape, float("-inf"), device=positions.device)
        recent = self.recent_window(view.budget)
        for b in range(positions.shape[0]):  # rows of a batch, at compaction only
            self._score_row(b, stats, view, positions[b], recent, out[b])
        return global_scores(out)

    def _score_row(
        self, b: int, stats: ThoughtStats, view: CacheView, pos: torch.Tensor, recent: int, out: torch.Tensor
    ) -> None:
        """Fill ``out`` (L,) for row b: kept representatives get their tier priority, other
        candidates stay -inf, non-candidates (protected) get a high finite score."""
        generated = pos - stats.prompt_len[b]
        cand = view.valid[b] & (generated >= 0) & (pos < view.seen[b] - recent)
        out.masked_fill_(view.valid[b] & ~cand, 10.0)
        slots = cand.nonzero().squeeze(-1)
        if slots.numel() == 0:
            return
        seg_of = (generated[slots] // self.segment).tolist()
        n_seg = stats.counts.shape[1]
        present = stats.counts[b] > 0
        sparsity = stats.sums[b] / stats.counts[b].clamp_min(1)
        tiers = torch.full((n_seg,), 1, dtype=torch.long)
        tiers[present.cpu()] = thought_tiers(sparsity[present]).cpu()
        counts = torch.bincount(torch.tensor(seg_of), minlength=n_seg).tolist()
        levels = stats.levels[b] + [0] * (n_seg - len(stats.levels[b]))
        room = view.budget - int((view.valid[b] & ~cand).sum())
        levels = plan_levels(counts, tiers.tolist(), levels, self.schedule, room)
        stats.levels[b] = levels
        seg_index = torch.tensor(seg_of, device=slots.device)
        fraction = pos.float() / float(view.seen[b])
        for s in range(n_seg):  # a few dozen segments at most, at compaction only
            members = slots[seg_index == s]
            if members.numel() == 0:
                continue
            cap = self.schedule[levels[s] - 1] if levels[s] else members.numel()
            if members.numel() > cap:
                features = self._features(view, b, members)
                members = members[kmeans_representatives(features, cap, self.kmeans_iters)]
            out[members] = 2.0 * (2 - float(tiers[s])) + 1.0 + fraction[members]

    def _features(self, view: CacheView, b: int, slots: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys of the classifier layers at ``slots``, heads and layers concatenated, (n, F)."""
        layers = self.resolved_layers()
        return torch.cat([view.keys(i)[b][:, slots, :].transpose(0, 1).flatten(1) for i in layers], dim=-1)
