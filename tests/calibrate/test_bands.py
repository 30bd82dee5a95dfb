"""Band choice on synthetic ρ curves: clear peaks, ties, weak and flat curves, undefined layers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from epikv.calibrate.stats import choose_bands


def _ci(rho, half=0.02):
    rho = np.asarray(rho, float)
    return rho - half, rho + half


def test_clear_peak_and_trough():
    rho = [0.01, 0.05, 0.20, 0.08, -0.02, -0.15, -0.30, -0.10]
    choice = choose_bands(rho, *_ci(rho))
    assert (choice.band_a, choice.band_b) == (2, 6)
    assert choice.rho_a == pytest.approx(0.20) and choice.ci_a == pytest.approx((0.18, 0.22))
    assert choice.rho_b == pytest.approx(-0.30)
    assert choice.warnings == [] and choice.near_a == [] and choice.near_b == []


def test_exact_ties_pick_lowest_layer_and_warn():
    rho = [0.1, 0.3, -0.2, 0.3, -0.2]
    choice = choose_bands(rho, *_ci(rho))
    assert (choice.band_a, choice.band_b) == (1, 2)
    assert any("[1, 3] tie for Band A" in w for w in choice.warnings)
    assert any("[2, 4] tie for Band B" in w for w in choice.warnings)


def test_layers_inside_the_interval_are_reported():
    rho = [0.0, 0.20, 0.19, 0.05, -0.1]
    choice = choose_bands(rho, *_ci(rho, half=0.03))
    assert choice.band_a == 1 and choice.near_a == [2]


def test_all_weak_signals_are_flagged():
    rho = [0.01, -0.01, 0.02, -0.015]
    choice = choose_bands(rho, *_ci(rho, half=0.05))
    assert (choice.band_a, choice.band_b) == (2, 3)
    assert sum("includes 0" in w for w in choice.warnings) == 2


def test_wrong_signs_are_flagged():
    rho = [0.3, 0.2, 0.1]
    choice = choose_bands(rho, *_ci(rho))
    assert choice.band_b == 2
    assert any("no layer has negative" in w for w in choice.warnings)
    rho = [-0.3, -0.2, -0.1]
    assert any("no layer has positive" in w for w in choose_bands(rho, *_ci(rho)).warnings)


def test_flat_curve_keeps_bands_distinct():
    rho = [0.0] * 5
    choice = choose_bands(rho, *_ci(rho))
    assert choice.band_a == 0 and choice.band_b == 1


def test_undefined_layers_are_never_chosen():
    nan = math.nan
    rho = [nan, 0.1, nan, -0.1]
    choice = choose_bands(rho, [nan, 0.05, nan, -0.15], [nan, 0.15, nan, -0.05])
    assert (choice.band_a, choice.band_b) == (1, 3)
    with pytest.raises(ValueError, match="constant"):
        choose_bands([nan, nan, 0.1], [nan] * 3, [nan] * 3)


def test_band_a_can_be_restricted_and_the_better_layer_is_reported():
    rho = [0.05, 0.10, -0.20, 0.30]
    choice = choose_bands(rho, *_ci(rho), allowed_a=range(3))
    assert (choice.band_a, choice.band_b) == (1, 2)
    assert any(
        "layer 3 has the largest ρ (+0.300) but is not allowed as Band A" in w for w in choice.warnings
    )
    assert choose_bands(rho, *_ci(rho)).band_a == 3
