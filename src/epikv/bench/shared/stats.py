"""Statistics of the fidelity study: bootstrap intervals over prompts, equal-peak-memory budgets and
kept-position histograms.

Pure functions on per-prompt numbers (the bootstrap is ``scipy.stats.bootstrap``'s); nothing here
runs a model or knows a policy. The unit of resampling is the prompt: tokens of one prompt are not
independent, so a per-token bootstrap would give intervals that are too narrow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import scipy.stats
from numpy.typing import ArrayLike

from epikv.spec import budget_for_peak

DEFAULT_RESAMPLES = 10_000


class CI(NamedTuple):
    """A point estimate with a two-sided confidence interval (percentile bootstrap) [low, high]."""

    mean: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def overlaps(self, other: CI) -> bool:
        return self.low <= other.high and other.low <= self.high


def _per_prompt(values: ArrayLike, name: str = "values") -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of per-prompt values, got {array.shape}")
    bad = int(np.count_nonzero(~np.isfinite(array)))
    if bad:
        raise ValueError(f"{name} has {bad} non-finite entries (drop skipped prompts before the bootstrap)")
    return array


def _check(resamples: int, level: float) -> None:
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")


def bootstrap_mean(
    values: ArrayLike, *, resamples: int = DEFAULT_RESAMPLES, level: float = 0.95, seed: int = 0
) -> CI:
    """Mean of per-prompt values with a percentile bootstrap interval over prompts.

    Args:
        values: (N,) one number per prompt (e.g. that prompt's mean top-1 agreement).
        resamples: B, the number of resamples of N prompts drawn with replacement.
        level: coverage of the interval; its ends are the (1 - level)/2 and (1 + level)/2 quantiles
            of the B resampled means (``scipy.stats.bootstrap``, percentile method).
        seed: seeds the ``numpy.random.Generator`` (PCG64), so equal inputs give equal intervals.

    Returns:
        ``CI(mean, low, high)``; ``mean`` is the plain mean of ``values``.
    """
    array = _per_prompt(values)
    _check(resamples, level)
    mean = float(array.mean())
    if array.size == 1:  # every resample is the one prompt (scipy wants two observations)
        return CI(mean, mean, mean)
    found = scipy.stats.bootstrap(
        (array,),
        np.mean,
        n_resamples=resamples,
        confidence_level=level,
        method="percentile",
        rng=np.random.default_rng(seed),
    ).confidence_interval
    return CI(mean, float(found.low), float(found.high))


def paired_difference(
    a: ArrayLike, b: ArrayLike, *, resamples: int = DEFAULT_RESAMPLES, level: float = 0.95, seed: int = 0
) -> CI:
    """Mean of a - b over prompts, two policies measured on the same N prompts, with a paired
    percentile bootstrap (the same resampled prompts for both, i.e. a bootstrap of the differences).

    Args:
        a, b: (N,) per-prompt values of policies A and B; entry i of both is prompt i.

    Returns:
        ``CI(mean_difference, low, high)``; ``excludes_zero`` says the difference is resolved
        at ``level``. Pairing removes the between-prompt spread that two separate intervals carry, so
        it can resolve a difference whose two separate intervals overlap.
    """
    first, second = _per_prompt(a, "a"), _per_prompt(b, "b")
    if first.shape != second.shape:
        raise ValueError(f"paired values need the same prompts: shapes {first.shape} and {second.shape}")
    return bootstrap_mean(first - second, resamples=resamples, level=level, seed=seed)


# --------------------------------------------------------------------------- equal peak memory


def match_budgets(
    peak: int, intervals: Mapping[str, int], min_budgets: Mapping[str, int] | int = 1
) -> dict[str, int]:
    """Per policy, the budget whose peak equals ``peak`` (policy name -> tau in, -> K out)."""
    floors = min_budgets if isinstance(min_budgets, Mapping) else dict.fromkeys(intervals, min_budgets)
    return {name: budget_for_peak(peak, tau, floors.get(name, 1)) for name, tau in intervals.items()}


class BudgetMatch(NamedTuple):
    """A budget chosen from measurements and the peak it is expected to give."""

    budget: int
    peak: float
    exact: bool  # a measured point has exactly the target peak


def budget_from_measured(
    pairs: Sequence[tuple[int, float]], target_peak: float, *, mode: str = "interpolate", min_budget: int = 1
) -> BudgetMatch:
    """Pick a budget from measured (K, peak) points when peak = K + tau does not hold exactly (e.g. a
    policy that compacts on a schedule of its own, or a mean peak over prompts of different lengths).

    Args:
        pairs: measured ``(budget, peak)`` points, any order; peak must not fall as K grows.
        target_peak: the peak to match.
        mode: ``"interpolate"``: linear between the two points around the target, the budget rounded
            down so the expected peak never exceeds the target (no extrapolation: a target outside
            the measured peaks is an error); ``"nearest"``: the measured point with the closest peak
            (ties go to the smaller budget).
        min_budget: a chosen budget below it is an error.
    """
    if mode not in ("interpolate", "nearest"):
        raise ValueError(f"mode must be 'interpolate' or 'nearest', got {mode!r}")
    if not pairs:
        raise ValueError("no measured (budget, peak) pairs")
    points = sorted((int(k), float(p)) for k, p in pairs)
    budgets = np.array([k for k, _ in points], dtype=np.float64)
    peaks = np.array([p for _, p in points], dtype=np.float64)
    if len(set(budgets.tolist())) != len(points) or np.any(np.diff(peaks) < 0):
        raise ValueError("measured pairs need distinct budgets and a peak that does not fall as K grows")
    exact = np.flatnonzero(peaks == target_peak)
    if exact.size:
        match = BudgetMatch(int(budgets[exact[0]]), float(target_peak), True)
    elif mode == "nearest":
        i = int(np.argmin(np.abs(peaks - target_peak)))  # argmin returns the first, i.e. smaller K
        match = BudgetMatch(int(budgets[i]), float(peaks[i]), False)
    else:
        if not peaks[0] < target_peak < peaks[-1]:
            span = f"[{peaks[0]}, {peaks[-1]}]"
            raise ValueError(f"target peak {target_peak} is outside the measured peaks {span}")
        hi = int(np.searchsorted(peaks, target_peak))  # peaks[hi - 1] < target < peaks[hi]
        slope = (budgets[hi] - budgets[hi - 1]) / (peaks[hi] - peaks[hi - 1])
        budget = math.floor(budgets[hi - 1] + slope * (target_peak - peaks[hi - 1]))
        peak = float(np.interp(budget, budgets, peaks))
        match = BudgetMatch(budget, peak, False)
    if match.budget < min_budget:
        raise ValueError(f"matched budget {match.budget} is below the minimum {min_budget}")
    return match


# --------------------------------------------------------------------------- what policies keep


def kept_position_histogram(
    kept_positions: Sequence[ArrayLike], lengths: Sequence[int] | int, bins: int = 10
) -> np.ndarray:
    """Where in the sequence the kept tokens sit, pooled over compactions.

    Args:
        kept_positions: one array per compaction of the true positions (0-based) kept, each (K_c,).
        lengths: tokens in the sequence at each compaction (one per compaction, or one for all);
            every kept position must be < its length.
        bins: equal-width bins of relative age r = position / (length - 1), 0 = the oldest token
            (the prompt's start), 1 = the newest; bin i covers [i/bins, (i+1)/bins), the last bin
            includes 1. A length-1 sequence has r = 0.

    Returns:
        (bins,) fraction of all kept tokens in each bin (sums to 1; all zeros if nothing was kept).
        A policy that keeps uniformly at random gives about 1/bins everywhere; recency piles into
        the last bins.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    sizes = [lengths] * len(kept_positions) if isinstance(lengths, int) else list(lengths)
    if len(sizes) != len(kept_positions):
        raise ValueError(f"{len(kept_positions)} compactions but {len(sizes)} lengths")
    counts = np.zeros(bins, dtype=np.int64)
    for c, (positions, length) in enumerate(zip(kept_positions, sizes, strict=True)):
        kept = np.asarray(positions, dtype=np.int64).reshape(-1)
        if length < 1 or np.any(kept < 0) or np.any(kept >= length):
            raise ValueError(f"compaction {c}: kept positions must lie in [0, {length})")
        # integer bin index floor(r * bins): exact, where float edges would misplace r = 0.3 and such
        index = np.minimum(kept * bins // max(1, length - 1), bins - 1)
        counts += np.bincount(index, minlength=bins)
    total = counts.sum()
    return counts / total if total else np.zeros(bins)


def describe(values: Sequence[float]) -> dict[str, float | int | list[float]] | None:
    """n, min, [25th, 50th, 75th] percentiles (numpy's linear rule), max and mean, to one decimal;
    None when empty."""
    if not values:
        return None
    q = np.percentile(values, [0, 25, 50, 75, 100]).round(1).tolist()
    mean = round(float(np.mean(values)), 1)
    return {"n": len(values), "min": q[0], "quartiles": q[1:4], "max": q[4], "mean": mean}
