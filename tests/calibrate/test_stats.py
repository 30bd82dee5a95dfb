"""Spearman ρ (against scipy's values, hard-coded) and the problem-level bootstrap."""

from __future__ import annotations

import numpy as np
import pytest

from epikv.calibrate.stats import bootstrap_spearman, rankdata, spearman, spearman_rows


def test_rankdata_averages_ties():
    # scipy.stats.rankdata([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    expected = [4.5, 1.5, 6.0, 1.5, 7.5, 10.0, 3.0, 9.0, 7.5, 4.5]
    assert rankdata(np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])).tolist() == expected


def test_rankdata_rows_are_independent():
    x = np.array([[1.0, 1.0, 2.0], [3.0, 2.0, 1.0]])
    assert rankdata(x).tolist() == [[1.5, 1.5, 3.0], [3.0, 2.0, 1.0]]


@pytest.mark.parametrize(
    ("x", "y", "expected"),
    [
        # values from scipy.stats.spearmanr(x, y).statistic (scipy 1.17)
        ([1, 2, 3, 4, 5], [5, 6, 7, 8, 7], 0.8207826816681233),
        ([0.3, 1.2, -0.5, 2.2, 0.9, 0.9, 4.0, -1.0], [0, 1, 0, 1, 1, 0, 1, 0], 0.8232319499226776),
        ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], 0.13471506281091267),
    ],
)
def test_spearman_matches_scipy(x, y, expected):
    assert spearman(np.array(x, float), np.array(y, float)) == pytest.approx(expected, abs=1e-12)


def test_spearman_rows_equals_rowwise_and_constant_is_nan():
    rng = np.random.default_rng(0)
    rows, labels = rng.normal(size=(5, 40)), rng.integers(0, 2, 40).astype(float)
    rows[2] = 1.0  # constant signal
    got = spearman_rows(rows, labels)
    assert np.isnan(got[2])
    for i in (0, 1, 3, 4):
        assert got[i] == pytest.approx(spearman(rows[i], labels), abs=1e-12)
    assert np.isnan(spearman_rows(rows[:1], np.zeros(40))[0])


def test_bootstrap_resamples_problems_not_tokens():
    # Problem 0: label rises with the signal; problem 1: falls. Pooled ρ is ~0, but a resample of
    # problems can hold only problem 0 (ρ = +1) or only problem 1 (ρ = -1): the interval must span
    # almost [-1, 1]. Resampling tokens would give a narrow interval around 0.
    x = np.tile(np.arange(50.0), 2)
    y = np.concatenate([np.arange(50.0), -np.arange(50.0)])
    groups = np.repeat([0, 1], 50)
    out = bootstrap_spearman(x[None], y, groups, resamples=400, seed=1)
    assert abs(out.rho[0]) < 0.05
    assert out.low[0] < -0.99 and out.high[0] > 0.99


def test_bootstrap_perfect_signal_and_levels():
    rng = np.random.default_rng(3)
    x = rng.normal(size=300)
    groups = np.repeat(np.arange(10), 30)
    exact = bootstrap_spearman(np.stack([x, -x]), x * 2 + 1, groups, resamples=100)
    assert exact.rho.tolist() == pytest.approx([1.0, -1.0])
    assert exact.low.tolist() == pytest.approx([1.0, -1.0]) and exact.high.tolist() == pytest.approx(
        [1.0, -1.0]
    )
    noisy_y = x + rng.normal(scale=2.0, size=300)
    wide = bootstrap_spearman(x[None], noisy_y, groups, resamples=300, level=0.95, seed=0)
    narrow = bootstrap_spearman(x[None], noisy_y, groups, resamples=300, level=0.5, seed=0)
    assert wide.low[0] < narrow.low[0] <= wide.rho[0] <= narrow.high[0] < wide.high[0]
    again = bootstrap_spearman(x[None], noisy_y, groups, resamples=300, level=0.95, seed=0)
    assert again.low[0] == wide.low[0] and again.high[0] == wide.high[0]


def test_bootstrap_rejects_bad_level():
    with pytest.raises(ValueError, match="level"):
        bootstrap_spearman(np.zeros((1, 4)), np.zeros(4), np.zeros(4), level=1.5)


def test_bootstrap_equals_pooling_the_drawn_problems():
    # The weighted-rank shortcut must give exactly what concatenating the drawn problems gives,
    # ties included (integer signals, binary labels).
    rng = np.random.default_rng(5)
    groups = np.repeat(np.arange(7), rng.integers(3, 12, 7))
    n = groups.size
    rows = rng.integers(0, 6, size=(4, n)).astype(float)
    labels = (rng.random(n) < 0.3).astype(float)
    got = bootstrap_spearman(rows, labels, groups, resamples=60, level=0.8, seed=11)
    draw_rng, members = np.random.default_rng(11), [np.flatnonzero(groups == g) for g in range(7)]
    draws = []
    for _ in range(60):
        index = np.concatenate([members[i] for i in draw_rng.integers(0, 7, size=7)])
        draws.append(spearman_rows(rows[:, index], labels[index]))
    low, high = np.nanpercentile(np.stack(draws), [10, 90], axis=0)
    np.testing.assert_allclose(got.low, low, atol=1e-10)
    np.testing.assert_allclose(got.high, high, atol=1e-10)


def test_spearman_of_a_small_tied_sample_by_hand():
    # ranks x = [1, 2.5, 2.5, 4], y = [1, 3, 2, 4]; deviations from 2.5 give sxy = 4.5, sxx = 4.5,
    # syy = 5, so rho = 4.5 / sqrt(22.5); the rows path and scipy's spearmanr agree.
    x, y = np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 3.0, 2.0, 4.0])
    assert spearman(x, y) == pytest.approx(4.5 / np.sqrt(22.5), abs=1e-12)
    assert spearman_rows(x[None], y)[0] == pytest.approx(4.5 / np.sqrt(22.5), abs=1e-12)
    assert np.isnan(spearman(np.ones(4), y))
