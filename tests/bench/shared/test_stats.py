"""Bootstrap intervals, equal-peak budgets and kept-position histograms against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from epikv import spec
from epikv.bench.shared import stats


def test_bootstrap_of_a_constant_or_a_single_prompt_is_a_point():
    assert stats.bootstrap_mean([0.5, 0.5, 0.5]) == (0.5, 0.5, 0.5)
    assert stats.bootstrap_mean([0.3], resamples=50) == (0.3, 0.3, 0.3)


def test_bootstrap_quantiles_of_two_prompts():
    # Resampled means of [0, 1] are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4: the 2.5% and 97.5%
    # quantiles are 0 and 1, the 30% and 70% quantiles both 0.5.
    assert stats.bootstrap_mean([0.0, 1.0]) == (0.5, 0.0, 1.0)
    assert stats.bootstrap_mean([0.0, 1.0], level=0.4) == (0.5, 0.5, 0.5)


def test_bootstrap_is_seeded_and_brackets_the_mean():
    values = np.linspace(0.0, 1.0, 40) ** 2
    first = stats.bootstrap_mean(values, resamples=2000, seed=3)
    assert first == stats.bootstrap_mean(values, resamples=2000, seed=3)
    assert first != stats.bootstrap_mean(values, resamples=2000, seed=4)
    assert first.low < first.mean < first.high
    narrower = stats.bootstrap_mean(values, resamples=2000, seed=3, level=0.5)
    assert first.low < narrower.low < narrower.high < first.high


def test_bootstrap_refuses_bad_input():
    with pytest.raises(ValueError, match="non-finite"):
        stats.bootstrap_mean([0.1, float("nan")])
    with pytest.raises(ValueError, match="1-D"):
        stats.bootstrap_mean([])
    with pytest.raises(ValueError, match="level"):
        stats.bootstrap_mean([1.0], level=1.0)


def test_paired_difference_resolves_a_shift_that_separate_intervals_cannot():
    b = np.array([0.2, 0.9, 0.4, 0.7, 0.5])
    a = b + 0.05  # A beats B by 0.05 on every prompt
    apart, together = stats.bootstrap_mean(a), stats.bootstrap_mean(b)
    assert apart.overlaps(together)
    diff = stats.paired_difference(a, b)
    assert diff.mean == pytest.approx(0.05) and diff.low == pytest.approx(0.05) and diff.excludes_zero
    assert stats.paired_difference([1.0, -1.0], [0.0, 0.0]) == (0.0, -1.0, 1.0)
    assert not stats.paired_difference([1.0, -1.0], [0.0, 0.0]).excludes_zero
    with pytest.raises(ValueError, match="same prompts"):
        stats.paired_difference([1.0, 2.0], [1.0])


def test_interval_overlap_and_zero():
    assert stats.CI(0.5, 0.4, 0.6).overlaps(stats.CI(0.7, 0.6, 0.8))
    assert not stats.CI(0.5, 0.4, 0.59).overlaps(stats.CI(0.7, 0.6, 0.8))
    assert stats.CI(-0.2, -0.3, -0.1).excludes_zero and not stats.CI(0, -0.1, 0.1).excludes_zero


def test_peak_and_budget_arithmetic():
    assert spec.peak_for_budget(256, 128) == 384  # epikv
    assert spec.peak_for_budget(256, 1) == 257  # streaming
    assert spec.peak_for_budget(256, 128, length=300) == 300
    assert spec.budget_for_peak(384, 128) == 256 and spec.budget_for_peak(384, 1) == 383
    assert stats.match_budgets(384, {"epikv": 128, "streaming": 1}) == {"epikv": 256, "streaming": 383}
    with pytest.raises(ValueError, match="128 leaves budget 128, below the minimum 160"):
        stats.match_budgets(256, {"epikv": 128, "streaming": 1}, {"epikv": 160})
    with pytest.raises(ValueError, match="below the minimum 1"):
        spec.budget_for_peak(128, 128)


def test_budget_from_measured_points():
    linear = [(384, 512), (128, 256), (256, 384)]
    assert stats.budget_from_measured(linear, 384) == (256, 384.0, True)
    assert stats.budget_from_measured(linear, 300) == (172, 300.0, False)
    # peak rises 1.8 per budget token: 100 + 50 / 1.8 = 127.8 -> 127, expected peak 150 + 27 * 1.8
    bent = [(100, 150.0), (200, 330.0)]
    match = stats.budget_from_measured(bent, 200)
    assert match.budget == 127 and match.peak == pytest.approx(198.6) and not match.exact
    assert stats.budget_from_measured(bent, 200, mode="nearest") == (100, 150.0, False)
    assert stats.budget_from_measured([(100, 150), (200, 250)], 200, mode="nearest").budget == 100  # tie
    with pytest.raises(ValueError, match="outside the measured peaks"):
        stats.budget_from_measured(bent, 400)
    with pytest.raises(ValueError, match="does not fall"):
        stats.budget_from_measured([(100, 300), (200, 250)], 260)
    with pytest.raises(ValueError, match="below the minimum 128"):
        stats.budget_from_measured(bent, 150, min_budget=128)


def test_kept_position_histogram():
    # positions 0, 1, 9 of 10 tokens: relative ages 0, 1/9, 1
    assert stats.kept_position_histogram([[0, 1, 9]], 10, bins=2).tolist() == pytest.approx([2 / 3, 1 / 3])
    # two compactions at lengths 5 and 9: ages 0, 1 and 1
    hist = stats.kept_position_histogram([np.array([0, 4]), np.array([8])], [5, 9], bins=4)
    assert hist.tolist() == pytest.approx([1 / 3, 0, 0, 2 / 3])
    everything = stats.kept_position_histogram([np.arange(101)], 101, bins=10)
    assert everything.tolist() == pytest.approx([10 / 101] * 9 + [11 / 101])
    assert stats.kept_position_histogram([[0]], 1, bins=3).tolist() == [1.0, 0.0, 0.0]
    assert stats.kept_position_histogram([], 10, bins=2).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"compaction 0: kept positions must lie in \[0, 5\)"):
        stats.kept_position_histogram([[5]], 5)
    with pytest.raises(ValueError, match="2 compactions but 1 lengths"):
        stats.kept_position_histogram([[0], [1]], [3])


def _hand_bootstrap(values, resamples, level, seed):
    """The bootstrap as epikv wrote it before it used scipy: the reference the library must match."""
    array = np.asarray(values, dtype=np.float64)
    draws = np.random.default_rng(seed).integers(0, array.size, size=(resamples, array.size))
    low, high = np.quantile(array[draws].mean(axis=1), [(1 - level) / 2, (1 + level) / 2])
    return float(array.mean()), float(low), float(high)


@pytest.mark.parametrize(("size", "resamples", "level", "seed"), [(2, 500, 0.95, 0), (17, 10_000, 0.95, 3),
                                                                   (40, 800, 0.8, 7)])  # fmt: skip
def test_bootstrap_gives_the_numbers_of_the_hand_written_one(size, resamples, level, seed):
    values = np.random.default_rng(size).normal(size=size)
    got = stats.bootstrap_mean(values, resamples=resamples, level=level, seed=seed)
    assert got == pytest.approx(_hand_bootstrap(values, resamples, level, seed), abs=1e-12)
