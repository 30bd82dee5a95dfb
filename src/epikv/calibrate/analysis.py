"""From pooled per-token signals and labels to the numbers of ``rho.json``.

This module owns the statistics of a run: ρ per label kind, signal and layer with problem-level
bootstrap intervals and the within-problem mean, the band choice, ρ of the policy's own score
s = signal_A - signal_B for the chosen and the core's default bands, and the record written as
``rho.json``. It reads arrays only; it knows nothing of models or files.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict
from typing import Any

import numpy as np

from epikv.calibrate.config import CalibrationConfig
from epikv.calibrate.signals import SIGNALS
from epikv.calibrate.stats import BandChoice, bootstrap_spearman, choose_bands, spearman_rows
from epikv.profiles import REFERENCE

LABEL_KINDS = ("loglik", "flip")


def rho_curves(pooled: dict[str, np.ndarray], config: CalibrationConfig) -> dict[str, Any]:
    """ρ over pooled tokens with its interval, for every label kind present, signal and layer; also
    ``rho_within``, the mean of per-problem ρ (a check on cross-problem structure, not used to choose)."""
    sig = pooled["signals"]
    n_signals, n_layers, n_tokens = sig.shape
    rows = sig.reshape(n_signals * n_layers, n_tokens)
    curves: dict[str, Any] = {}
    for kind in LABEL_KINDS:
        if kind not in pooled:
            continue
        y = pooled[kind]
        interval = bootstrap_spearman(rows, y, pooled["groups"], config.bootstrap, config.level, config.seed)
        within = within_problem_rho(rows, y, pooled["groups"])
        by_signal = {}
        for s, name in enumerate(SIGNALS):
            part = slice(s * n_layers, (s + 1) * n_layers)
            by_signal[name] = {
                "rho": _clean(interval.rho[part]),
                "ci_low": _clean(interval.low[part]),
                "ci_high": _clean(interval.high[part]),
                "rho_within": _clean(within[part]),
            }
        curves[kind] = {
            "n_tokens": int(n_tokens),
            "positive_fraction": float((y > 0).mean()),
            "signals": by_signal,
        }
    return curves


def within_problem_rho(rows: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Mean over problems of each row's within-problem Spearman ρ (constant-label problems skipped)."""
    per = [spearman_rows(rows[:, groups == g], labels[groups == g]) for g in np.unique(groups)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: no problem had varying labels
        return np.nanmean(np.stack(per), axis=0)


def _clean(values: np.ndarray) -> list[float | None]:
    return [None if math.isnan(v) else round(float(v), 6) for v in values]


def _nan(values: list[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]


def choose(curves: dict[str, Any], config: CalibrationConfig) -> BandChoice:
    """Bands from the chosen label kind and signal. Band A is never the last layer: the default
    ``epikv`` policy (EpiKV-SegQ) projects its recent queries at layer A + 1."""
    curve = curves[config.labels.kind]["signals"][config.signal]
    allowed_a = range(len(curve["rho"]) - 1)
    return choose_bands(_nan(curve["rho"]), _nan(curve["ci_low"]), _nan(curve["ci_high"]), allowed_a)


def at_layers(curve: dict[str, list[float | None]], layers: dict[str, int]) -> dict[str, Any]:
    """ρ and interval of one curve at named layers (e.g. the scaled default bands, for comparison)."""
    return {
        name: {
            "layer": layer,
            "rho": curve["rho"][layer],
            "ci": [curve["ci_low"][layer], curve["ci_high"][layer]],
        }
        for name, layer in layers.items()
    }


def scaled_bands(num_layers: int) -> dict[str, int]:
    """The core's fallback bands for a model without a profile (as :func:`epikv.profiles.scaled_profile`,
    without its warning, which is meant for users running a model uncalibrated)."""
    n, a, b = REFERENCE
    return {
        "band_a": min(num_layers - 1, round(a * num_layers / n)),
        "band_b": min(num_layers - 1, round(b * num_layers / n)),
    }


def score_rho(
    pooled: dict[str, np.ndarray], config: CalibrationConfig, pairs: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    """ρ (with interval) of the policy's own score s = signal_A - signal_B for band pairs, per label kind.

    The per-layer curves rate each band alone; this rates the difference the policy ranks tokens by.
    """
    signal = pooled["signals"][SIGNALS.index(config.signal)]  # (L, N)
    rows = {name: signal[a] - signal[b] for name, (a, b) in pairs.items()}
    out = {"signal": config.signal, **rho_of_rows(rows, pooled, config)}
    for kind in LABEL_KINDS:
        for name, (a, b) in pairs.items():
            if kind in out:
                out[kind][name] = {"band_a": a, "band_b": b, **out[kind][name]}
    return out


def position_rho(pooled: dict[str, np.ndarray], config: CalibrationConfig) -> dict[str, Any]:
    """ρ of each token's relative position in its span (0 at the start, near 1 before the answer).

    A reference, not a signal: how positional the labels are, which the z-score removes by design.
    """
    groups = pooled["groups"]
    relative = np.zeros(groups.shape[0])
    for g in np.unique(groups):
        at = np.flatnonzero(groups == g)
        relative[at] = np.arange(at.size) / at.size
    return rho_of_rows({"relative_position": relative}, pooled, config)


def rho_of_rows(
    rows: dict[str, np.ndarray], pooled: dict[str, np.ndarray], config: CalibrationConfig
) -> dict[str, Any]:
    """For each label kind present and each named row (N,): ρ, its interval and the within-problem ρ."""
    names, stacked = list(rows), np.stack(list(rows.values()))
    out: dict[str, Any] = {}
    for kind in LABEL_KINDS:
        if kind not in pooled:
            continue
        found = bootstrap_spearman(
            stacked, pooled[kind], pooled["groups"], config.bootstrap, config.level, config.seed
        )
        within = within_problem_rho(stacked, pooled[kind], pooled["groups"])
        out[kind] = {
            name: {
                "rho": _clean(found.rho[i : i + 1])[0],
                "ci": _clean(np.array([found.low[i], found.high[i]])),
                "rho_within": _clean(within[i : i + 1])[0],
            }
            for i, name in enumerate(names)
        }
    return out


def rho_record(
    model: str, config: CalibrationConfig, curves: dict[str, Any], choice: BandChoice, traces: dict[str, Any]
) -> dict[str, Any]:
    """The content of ``rho.json``: every curve, the choice, the core's default bands for comparison."""
    chosen = curves[config.labels.kind]["signals"][config.signal]
    num_layers = len(chosen["rho"])
    return {
        "model": model,
        "num_layers": num_layers,
        "n_problems": traces["used"],
        "config": asdict(config),
        "bootstrap": {
            "unit": "problem",
            "resamples": config.bootstrap,
            "level": config.level,
            "seed": config.seed,
        },
        "labels": curves,
        "choice": {"label": config.labels.kind, "signal": config.signal, **choice.to_dict()},
        "scaled_default": at_layers(chosen, scaled_bands(num_layers)),
        "traces": traces,
    }
