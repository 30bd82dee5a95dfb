"""Band calibration: find which layers' hidden-state change predicts token importance for a model.

``epikv calibrate`` traces problems greedily, labels reasoning tokens by occlusion (paper §1.8),
correlates each layer's step-change signals with those labels (Spearman ρ with problem-level
bootstrap intervals), picks Band A (most positive ρ) and Band B (most negative) and writes a model
profile that EpiKV finds automatically. See docs/calibration.md.

Modules: ``traces`` (generation, answer start, answer key), ``occlusion`` (windows, fillers, labels,
with an injectable scorer), ``scorer`` (the model-backed scorer with a prefix cache), ``signals``
(per-layer step change, rolling mean and z-score), ``stats`` (Spearman, bootstrap, band choice),
``profile`` (provenance and writing), ``plot`` (ρ against layer from ``rho.json``), ``pipeline``
(the run) and ``cli``.
"""

from __future__ import annotations

from epikv.calibrate.occlusion import FunctionScorer, Labeller, LabelSettings, windows
from epikv.calibrate.pipeline import CalibrationConfig, run_calibration
from epikv.calibrate.stats import BandChoice, bootstrap_spearman, choose_bands, spearman

__all__ = [
    "BandChoice",
    "CalibrationConfig",
    "FunctionScorer",
    "LabelSettings",
    "Labeller",
    "bootstrap_spearman",
    "choose_bands",
    "run_calibration",
    "spearman",
    "windows",
]
