"""Per-model EpiKV band profiles: which layers are Band A (change = important) and Band B.

A profile is a small JSON file keyed by the model's identity. Lookup order (:func:`profile_sources`,
the one rule both the lookup and ``epikv profile list`` use): the user's profile folder, then the
profiles shipped in the package, then the built-in table of the paper's models. A model with none
gets the paper's Llama-8B bands scaled by depth, with a warning: that guess is known to be poor on
small models (see the README).

Nothing writes the user folder behind the user's back: ``epikv calibrate`` writes its profile only
into its run folder, and :func:`install_profile` (``epikv profile use``) is the one explicit step
that makes a calibrated profile active; it refuses a profile whose own calibration warnings say the
signal is weak unless forced. :func:`reset_profile` (``epikv profile reset``) removes the override.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from epikv.paths import model_cache_dir

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
    try:
        return BandProfile(**json.loads(Path(path).read_text()))
    except (TypeError, json.JSONDecodeError) as err:  # not JSON, or not a profile's fields
        raise ValueError(f"{path} is not an EpiKV band profile ({err})") from err


# Phrases of the warnings ``epikv calibrate`` records (epikv.calibrate.stats.choose_bands) when the
# data do not support the bands: an interval around 0 or the wrong sign at a band.
WEAK_SIGNAL_MARKERS = ("weak signal", "no layer has positive", "no layer has negative")


def weak_signal_warnings(profile: BandProfile) -> list[str]:
    """The profile's own recorded calibration warnings that say its signal is weak (none: not weak)."""
    recorded = profile.details.get("warnings", [])
    return [w for w in recorded if isinstance(w, str) and any(m in w for m in WEAK_SIGNAL_MARKERS)]


@dataclass(frozen=True)
class ProfileSource:
    """One place a model's bands can come from: ``kind`` user | shipped | paper, ``where`` a path,
    the shipped file's name or the paper's table."""

    kind: str
    where: str
    profile: BandProfile

    @property
    def origin(self) -> str:
        """The line saved with results and printed by every run (``Bands.origin``)."""
        return "paper (authors' repo)" if self.kind == "paper" else f"{self.kind} profile {self.where}"


def _shipped_folder() -> Any:
    return resources.files("epikv").joinpath("data", "profiles")


def profile_sources(model: str) -> list[ProfileSource]:
    """Every profile of a model identity, in lookup order: the first one is the one in use."""
    sources = []
    user = user_profile_dir() / profile_filename(model)
    if user.is_file():
        sources.append(ProfileSource("user", str(user), load_profile_file(user)))
    shipped = _shipped_folder().joinpath(profile_filename(model))
    if shipped.is_file():
        profile = BandProfile(**json.loads(shipped.read_text()))
        sources.append(ProfileSource("shipped", profile_filename(model), profile))
    if model in BUILTIN:
        n, a, b = BUILTIN[model]
        profile = BandProfile(model, n, a, b, method="paper (authors' repo)")
        sources.append(ProfileSource("paper", "authors' repo", profile))
    return sources


def known_models() -> list[str]:
    """Every model identity with a profile: the user folder's, the shipped ones, the paper's."""
    names = set(BUILTIN)
    folders: list[Any] = [_shipped_folder()]
    if user_profile_dir().is_dir():
        folders.append(user_profile_dir())
    for folder in folders:
        for entry in folder.iterdir():
            if entry.name.endswith(".json"):
                names.add(load_profile_file(entry).model)
    return sorted(names)


def find_profile(model: str, num_layers: int) -> BandProfile:
    """The band profile for a model identity; scaled paper bands (with a warning) when none exists."""
    return locate_profile(model, num_layers)[0]


def locate_profile(model: str, num_layers: int) -> tuple[BandProfile, str]:
    """The band profile for a model identity and where it came from (a line for logs and configs).
    A user profile says which profile it overrides, so no run hides that the user changed the bands."""
    sources = profile_sources(model)
    if not sources:
        profile = scaled_profile(model, num_layers)
        return profile, profile.method
    chosen = sources[0]
    if chosen.profile.num_layers != num_layers:
        raise ValueError(
            f"{chosen.origin} for {model} is for {chosen.profile.num_layers} layers but the model has "
            f"{num_layers}"
        )
    origin = chosen.origin
    if chosen.kind == "user" and len(sources) > 1:
        origin += f", over {sources[1].origin}"
    if chosen.kind == "user" and weak_signal_warnings(chosen.profile):
        origin += ", weak signal"
    return chosen.profile, origin


def install_profile(path: Path, force: bool = False) -> tuple[Path, BandProfile]:
    """Make a calibrated profile the one its model uses (copy it into the user folder).

    Refuses, with ValueError, a profile whose own calibration warnings say the signal is weak
    unless ``force``; the installed copy records where it came from and whether it was forced."""
    profile = load_profile_file(path)
    weak = weak_signal_warnings(profile)
    if weak and not force:
        raise ValueError(
            f"{path}: not installed: its calibration says the signal is weak ({weak[0]}"
            f"{f'; {len(weak) - 1} more' if len(weak) > 1 else ''}); use --force to install it anyway"
        )
    installed = {"from": str(Path(path).resolve()), "forced": bool(weak), "date": _today()}
    copy = replace(profile, details={**profile.details, "installed": installed})
    return save_profile(copy), copy


def reset_profile(model: str) -> Path | None:
    """Remove a model's user profile (the override); returns the removed path, None if there was none."""
    path = user_profile_dir() / profile_filename(model)
    if not path.is_file():
        return None
    path.unlink()
    return path


def _today() -> str:
    import datetime as dt

    return dt.date.today().isoformat()


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
