"""Rank statistics for calibration: Spearman ρ, problem-level bootstrap intervals, band choice.

This module owns the numbers that turn per-token signals and labels into a band choice. It is pure
numpy and scipy: it knows nothing of models, traces or profiles. Spearman ρ and the ranks are
scipy's (ties share the mean of the ranks they span). The problem-level bootstrap stays here:
``scipy.stats.bootstrap`` resamples observations, not groups of them, and cannot drop the resamples
where ρ is undefined; its rows are vectorised so a bootstrap over all layers and signals costs one
cumulative sum per resample.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import scipy.stats
from scipy.stats import ConstantInputWarning, spearmanr


def rankdata(x: np.ndarray) -> np.ndarray:
    """Average ranks (1-based) along the last axis (``scipy.stats.rankdata``); ties get the mean of
    the ranks they occupy. x: (..., N). Returns float64 of the same shape."""
    return scipy.stats.rankdata(x, axis=-1).astype(np.float64)


def spearman_rows(rows: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Spearman ρ of each row of ``rows`` (R, N) with ``labels`` (N,); NaN where either is constant.

    The Pearson correlation of scipy's average ranks, vectorised over rows (``scipy.stats.spearmanr``
    on R rows computes the whole (R + 1)² matrix); it equals :func:`spearman` row by row."""
    rows = np.atleast_2d(np.asarray(rows, dtype=np.float64))
    ranked = rankdata(rows)
    ranked -= ranked.mean(axis=-1, keepdims=True)
    y = rankdata(np.asarray(labels, dtype=np.float64))
    y -= y.mean()
    return _correlation((ranked * ranked).sum(axis=-1), y @ y, ranked @ y)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman ρ of two 1-D arrays (``scipy.stats.spearmanr``; NaN when either is constant)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConstantInputWarning)  # constant input: ρ undefined, NaN
        return float(spearmanr(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)).statistic)


@dataclass(frozen=True)
class CI:
    """Point estimate and percentile bootstrap confidence interval of ρ for each row."""

    rho: np.ndarray  # (R,)
    low: np.ndarray  # (R,)
    high: np.ndarray  # (R,)


def bootstrap_spearman(
    rows: np.ndarray,
    labels: np.ndarray,
    groups: np.ndarray,
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> CI:
    """ρ of each row with the labels, and a percentile interval from resampling *groups* (problems).

    rows: (R, N) signals; labels: (N,); groups: (N,) integer problem id of each token. Tokens of one
    trace are strongly dependent (neighbours share windows and rolling statistics), so the unit of
    resampling is the problem: each resample draws problems with replacement and pools their tokens.
    Resamples where ρ is undefined (constant labels) are dropped from the interval.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rows = np.atleast_2d(np.asarray(rows, dtype=np.float64))
    labels = np.asarray(labels, dtype=np.float64)
    point = spearman_rows(rows, labels)
    unique, index = np.unique(np.asarray(groups), return_inverse=True)
    x_sorted, y_sorted = _SortedRanks(rows), _SortedRanks(labels[None])
    rng = np.random.default_rng(seed)
    draws = np.full((resamples, rows.shape[0]), np.nan)
    for b in range(resamples):
        counts = np.bincount(rng.integers(0, len(unique), size=len(unique)), minlength=len(unique))
        weights = counts[index].astype(np.float64)  # a drawn problem's tokens count once per draw
        draws[b] = _weighted_rho(x_sorted.ranks(weights), y_sorted.ranks(weights)[0], weights)
    if resamples == 0:
        return CI(point, np.full_like(point, np.nan), np.full_like(point, np.nan))
    tail = (1.0 - level) / 2.0 * 100.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: ρ undefined in every resample
        low, high = np.nanpercentile(draws, [tail, 100.0 - tail], axis=0)
    return CI(point, low, high)


class _SortedRanks:
    """Average ranks of rows under integer token weights, without re-sorting for every resample.

    Pooling the drawn problems repeats each token ``weight`` times; its average rank in that pool is
    the weight of all smaller values plus the mean position inside its tie group, which one cumulative
    sum over the rows' fixed sort order gives.
    """

    def __init__(self, rows: np.ndarray) -> None:
        self.order = np.argsort(rows, axis=-1, kind="stable")
        ordered = np.take_along_axis(rows, self.order, axis=-1)
        n = rows.shape[-1]
        first = np.ones(ordered.shape, dtype=bool)
        first[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
        last = np.ones(ordered.shape, dtype=bool)
        last[..., :-1] = first[..., 1:]
        index = np.broadcast_to(np.arange(n), ordered.shape)
        self.start = np.maximum.accumulate(np.where(first, index, 0), axis=-1)
        self.end = np.flip(np.minimum.accumulate(np.flip(np.where(last, index, n), -1), axis=-1), -1)

    def ranks(self, weights: np.ndarray) -> np.ndarray:
        """(R, N) average ranks in original token order (meaningless where the weight is 0)."""
        w = weights[self.order]
        total = np.cumsum(w, axis=-1)
        before = np.take_along_axis(total - w, self.start, axis=-1)
        group = np.take_along_axis(total, self.end, axis=-1) - before
        out = np.empty(w.shape)
        np.put_along_axis(out, self.order, before + (group + 1.0) / 2.0, axis=-1)
        return out


def _weighted_rho(rx: np.ndarray, ry: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Pearson correlation of rank rows rx (R, N) with ry (N,) under token weights: Spearman ρ of the pool."""
    total = weights.sum()
    dx = rx - (rx @ weights / total)[:, None]
    dy = ry - ry @ weights / total
    return _correlation((dx * dx) @ weights, (dy * dy) @ weights, (dx * weights) @ dy)


def _correlation(sxx: np.ndarray, syy: float, sxy: np.ndarray) -> np.ndarray:
    """sxy / sqrt(sxx syy), NaN where either side is constant. Sums of squared rank deviations are
    0 or at least 1/2 (ranks are multiples of 1/2), so a threshold far below that only absorbs rounding."""
    constant = (sxx < 1e-6) | (syy < 1e-6)
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = sxy / np.sqrt(sxx * syy)
    return np.where(constant, np.nan, rho)


@dataclass(frozen=True)
class BandChoice:
    """The chosen bands, their ρ and intervals, and everything that makes the choice doubtful."""

    band_a: int
    band_b: int
    rho_a: float
    ci_a: tuple[float, float]
    rho_b: float
    ci_b: tuple[float, float]
    near_a: list[int] = field(default_factory=list)  # other layers whose ρ lies inside A's interval
    near_b: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_bands(
    rho: Sequence[float],
    low: Sequence[float],
    high: Sequence[float],
    allowed_a: Sequence[int] | None = None,
) -> BandChoice:
    """Band A = layer of largest ρ, Band B = layer of most negative ρ (lowest layer on exact ties).

    Nothing is hidden: exact ties, layers statistically indistinguishable from the chosen one (their
    ρ lies inside its interval), intervals that include 0 and wrong signs all become warnings. When
    every layer has the same ρ, B is the lowest layer other than A so the two bands still differ.
    Layers with an undefined ρ (NaN) are never chosen. ``allowed_a`` restricts Band A (a policy may
    need a layer after it); a better layer left out that way is reported too.
    """
    rho_arr = np.asarray(rho, dtype=np.float64)
    low_arr, high_arr = np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)
    valid = np.flatnonzero(~np.isnan(rho_arr))
    candidates_a = valid if allowed_a is None else np.intersect1d(valid, np.asarray(allowed_a, dtype=int))
    if valid.size < 2 or candidates_a.size == 0:
        raise ValueError("ρ is undefined at all but at most one layer: labels or signals are constant")
    warnings: list[str] = []
    a = _extreme(rho_arr, candidates_a, highest=True, label="A", warnings=warnings)
    best = int(valid[np.argmax(rho_arr[valid])])
    if rho_arr[best] > rho_arr[a]:
        warnings.append(
            f"layer {best} has the largest ρ ({rho_arr[best]:+.3f}) but is not allowed as Band A; "
            f"chose layer {a} ({rho_arr[a]:+.3f})"
        )
    b = _extreme(rho_arr, valid[valid != a], highest=False, label="B", warnings=warnings)
    if rho_arr[a] <= 0:
        warnings.append(f"no layer has positive ρ: Band A = layer {a} has ρ = {rho_arr[a]:+.3f}")
    if rho_arr[b] >= 0:
        warnings.append(f"no layer has negative ρ: Band B = layer {b} has ρ = {rho_arr[b]:+.3f}")
    for name, layer in (("A", a), ("B", b)):
        if low_arr[layer] <= 0 <= high_arr[layer] or np.isnan(low_arr[layer]):
            warnings.append(
                f"Band {name} (layer {layer}): interval [{low_arr[layer]:+.3f}, {high_arr[layer]:+.3f}] "
                "includes 0 (weak signal)"
            )
    return BandChoice(
        band_a=a,
        band_b=b,
        rho_a=float(rho_arr[a]),
        ci_a=(float(low_arr[a]), float(high_arr[a])),
        rho_b=float(rho_arr[b]),
        ci_b=(float(low_arr[b]), float(high_arr[b])),
        near_a=_inside(rho_arr, valid, a, low_arr[a], high_arr[a]),
        near_b=_inside(rho_arr, valid, b, low_arr[b], high_arr[b]),
        warnings=warnings,
    )


def _extreme(
    rho: np.ndarray, candidates: np.ndarray, *, highest: bool, label: str, warnings: list[str]
) -> int:
    values = rho[candidates]
    best = values.max() if highest else values.min()
    tied = candidates[values == best]
    if tied.size > 1:
        warnings.append(
            f"layers {tied.tolist()} tie for Band {label} at ρ = {best:+.3f}; chose layer {tied[0]}"
        )
    return int(tied[0])


def _inside(rho: np.ndarray, valid: np.ndarray, chosen: int, low: float, high: float) -> list[int]:
    return [int(i) for i in valid if i != chosen and low <= rho[i] <= high]
