"""The settings of a calibration run (saved as ``config.json`` next to its results)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from epikv.calibrate.occlusion import LabelSettings
from epikv.calibrate.signals import SIGNALS
from epikv.calibrate.traces import DEFAULT_MARKERS

KEEP = ("all", "answered", "correct")


@dataclass(frozen=True)
class CalibrationConfig:
    """Everything a run depends on (saved as ``config.json`` next to its results)."""

    dataset: str = "gsm8k"
    model: str | None = None
    limit: int = 30
    offset: int = 0
    max_new_tokens: int = 384
    batch_size: int = 8
    keep: str = "answered"
    labels: LabelSettings = field(default_factory=LabelSettings)
    rolling: int = 64
    signal: str = "zscore"
    bootstrap: int = 1000
    level: float = 0.95
    seed: int = 0
    traces: str | None = None
    markers: tuple[str, ...] = DEFAULT_MARKERS
    dtype: str = "float32"  # the model's weights and activations (bfloat16: the precision a study runs in)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, got {self.keep!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {SIGNALS}, got {self.signal!r}")
        if self.limit < 1 or self.max_new_tokens < 1 or self.bootstrap < 0:
            raise ValueError(
                f"need limit >= 1, max_new_tokens >= 1, bootstrap >= 0; got {self.limit}, "
                f"{self.max_new_tokens}, {self.bootstrap}"
            )


def config_from_file(path: Path) -> CalibrationConfig:
    """The CalibrationConfig saved as a run's ``config.json``."""
    raw = json.loads(Path(path).read_text())
    raw["labels"] = LabelSettings(**raw["labels"])
    raw["markers"] = tuple(raw.get("markers", DEFAULT_MARKERS))
    return CalibrationConfig(**raw)
