"""Per-model EpiKV band profiles: which layers are Band A (change = important) and Band B.

A profile is a small JSON file keyed by the model's identity. Lookup order: the user's profile
folder (where ``epikv calibrate`` writes), then the profiles shipped in the package, then the
built-in table of the paper's models. A model with none gets the paper's Llama-8B bands scaled by
depth, with a warning: that guess is known to be poor on small models (see the README).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The paper's bands (authors' repo, method-and-baselines.md §1.3): representative layers.
BUILTIN: dict[str, tuple[int, int, int]] = {
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": (32, 10, 21),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": (28, 20, 24),
}
REFERENCE = (32, 10, 21)  # Llama-8B, used to scale bands for an unknown model


@dataclass(frozen=True)
class BandProfile:
    """Bands of one model and how they were found."""

    model: str
    num_layers: int
    band_a: int
    band_b: int
    method: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("band_a", "band_b"):
            value = getattr(self, name)
            if not 0 <= value < self.num_layers:
                raise ValueError(f"profile for {self.model}: {name}={value} outside 0..{self.num_layers - 1}")


def user_profile_dir() -> Path:
    """The ``profiles/`` folder of EpiKV's cache folder (same rule as the converted models)."""
    from epikv.models import model_cache_dir

    return model_cache_dir() / "profiles"


def profile_filename(model: str) -> str:
    return model.replace("/", "__").replace(os.sep, "__") + ".json"


def save_profile(profile: BandProfile, folder: Path | None = None) -> Path:
    folder = folder or user_profile_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / profile_filename(profile.model)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(profile), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def load_profile_file(path: Path) -> BandProfile:
    return BandProfile(**json.loads(Path(path).read_text()))


def _shipped(model: str) -> BandProfile | None:
    entry = resources.files("epikv").joinpath("profiles", profile_filename(model))
    if entry.is_file():
        return BandProfile(**json.loads(entry.read_text()))
    return None


def find_profile(model: str, num_layers: int) -> BandProfile:
    """The band profile for a model identity; scaled paper bands (with a warning) when none exists."""
    return locate_profile(model, num_layers)[0]


def locate_profile(model: str, num_layers: int) -> tuple[BandProfile, str]:
    """The band profile for a model identity and where it came from (a line for logs and configs)."""
    user = user_profile_dir() / profile_filename(model)
    if user.is_file():
        found, origin = load_profile_file(user), f"user profile {user}"
    else:
        found, origin = _shipped(model), f"shipped profile {profile_filename(model)}"
    if found is None and model in BUILTIN:
        n, a, b = BUILTIN[model]
        found, origin = BandProfile(model, n, a, b, method="paper (authors' repo)"), "paper (authors' repo)"
    if found is not None:
        if found.num_layers != num_layers:
            raise ValueError(
                f"profile for {model} is for {found.num_layers} layers but the model has {num_layers}"
            )
        return found, origin
    profile = scaled_profile(model, num_layers)
    return profile, profile.method


def scaled_profile(model: str, num_layers: int) -> BandProfile:
    """Llama-8B's bands 10/21 of 32 scaled to ``num_layers`` (a guess; calibrate instead)."""
    n, a, b = REFERENCE
    band_a = min(num_layers - 1, round(a * num_layers / n))
    band_b = min(num_layers - 1, round(b * num_layers / n))
    log.warning(
        "no EpiKV band profile for %s; using Llama-8B bands scaled by depth (A=%d, B=%d). "
        "Run `epikv calibrate` for this model.",
        model,
        band_a,
        band_b,
    )
    return BandProfile(model, num_layers, band_a, band_b, method="scaled from Llama-8B 10/21 of 32")
