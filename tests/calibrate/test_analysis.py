"""The statistics of a run from pooled arrays: curves, the policy's own score, the record."""

from __future__ import annotations

import numpy as np
import pytest

from epikv.calibrate.analysis import choose, position_rho, rho_curves, score_rho
from epikv.calibrate.config import CalibrationConfig


def _pooled(n_problems: int = 6, per: int = 40, layers: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = n_problems * per
    signals = rng.normal(size=(3, layers, n))
    label = rng.normal(size=n)
    signals[2, 1] = label + 0.01 * rng.normal(size=n)  # z-score at layer 1 tracks the label
    signals[2, 3] = -label  # and layer 3 against it
    return {"signals": signals, "loglik": label, "groups": np.repeat(np.arange(n_problems), per)}


def test_curves_find_the_planted_layers():
    curves = rho_curves(_pooled(), CalibrationConfig(bootstrap=50))
    z = curves["loglik"]["signals"]["zscore"]
    assert np.argmax(z["rho"]) == 1 and np.argmin(z["rho"]) == 3
    assert z["rho"][1] > 0.99 and z["rho"][3] == pytest.approx(-1.0)
    assert z["ci_low"][1] <= z["rho"][1] <= z["ci_high"][1]
    assert z["rho_within"][3] == pytest.approx(-1.0)
    assert set(curves) == {"loglik"} and curves["loglik"]["n_tokens"] == 240


def test_score_rho_rates_the_band_difference():
    pooled = _pooled()
    out = score_rho(
        pooled, CalibrationConfig(bootstrap=50), {"good": (1, 3), "reversed": (3, 1), "noise": (0, 2)}
    )
    assert out["signal"] == "zscore"
    assert out["loglik"]["good"]["rho"] > 0.99 and out["loglik"]["reversed"]["rho"] < -0.99
    assert abs(out["loglik"]["noise"]["rho"]) < 0.2
    assert out["loglik"]["good"]["band_a"] == 1 and out["loglik"]["good"]["band_b"] == 3
    assert len(out["loglik"]["noise"]["ci"]) == 2


def test_position_reference():
    pooled = _pooled(n_problems=4, per=30)
    pooled["loglik"] = np.tile(np.arange(30.0) ** 2, 4)  # labels rise along every span
    out = position_rho(pooled, CalibrationConfig(bootstrap=20))["loglik"]["relative_position"]
    assert out["rho"] == pytest.approx(1.0) and out["rho_within"] == pytest.approx(1.0)


def test_band_a_is_never_the_last_layer():
    pooled = _pooled()
    pooled["signals"][2, 4] = pooled["loglik"] * 2  # the last layer tracks the label best
    curves = rho_curves(pooled, CalibrationConfig(bootstrap=20))
    choice = choose(curves, CalibrationConfig())
    assert choice.band_a == 1 and any("layer 4" in w for w in choice.warnings)
