"""Turning a band choice into a model profile, with the record of how it was chosen.

This module owns the profile's provenance record (what data, labels, signal and statistics chose the
bands, when, with which epikv, and the warnings that make the choice doubtful) and where it is
written: the run's output folder only. Making it the profile a model uses is the user's explicit
step (``epikv profile use``, :func:`epikv.profiles.install_profile`), which reads those warnings.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from epikv.calibrate.stats import BandChoice
from epikv.profiles import BandProfile, save_profile


def epikv_version() -> str:
    import epikv

    return epikv.__version__


def build_profile(
    model: str, num_layers: int, choice: BandChoice, label: str, signal: str, provenance: dict[str, Any]
) -> BandProfile:
    """A BandProfile whose ``details`` say how it was made (provenance plus the chosen layers' ρ)."""
    details = {
        **provenance,
        "label": label,
        "signal": signal,
        "band_a": {
            "layer": choice.band_a,
            "rho": choice.rho_a,
            "ci": list(choice.ci_a),
            "near": choice.near_a,
        },
        "band_b": {
            "layer": choice.band_b,
            "rho": choice.rho_b,
            "ci": list(choice.ci_b),
            "near": choice.near_b,
        },
        "warnings": list(choice.warnings),
        "date": dt.date.today().isoformat(),
        "epikv_version": epikv_version(),
    }
    method = f"epikv calibrate: Spearman ρ of the {signal} signal against {label} occlusion labels"
    return BandProfile(model, num_layers, choice.band_a, choice.band_b, method=method, details=details)


def write_profile(profile: BandProfile, out: Path) -> Path:
    """Writes the profile into the run folder ``out`` (never into the user profile folder)."""
    return save_profile(profile, out)
