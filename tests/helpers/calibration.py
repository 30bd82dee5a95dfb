"""A calibration run folder made without a model, and the random traces it holds."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np

from epikv.calibrate.occlusion import LabelSettings
from epikv.calibrate.pipeline import CalibrationConfig
from epikv.calibrate.traces import Trace, save_traces


def random_traces(n: int) -> list[Trace]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        prompt, output = rng.integers(3, 97, 12).tolist(), rng.integers(3, 97, 60).tolist()
        out.append(Trace(f"p{i}", prompt, output, True, 12 + 48, "tail", str(i), correct=i % 2 == 0))
    return out


def reusable_run(out):
    """A run folder for "tiny/calib" (4 layers) that `--reuse` accepts, with random signals: what a
    model run leaves behind, made without a model."""
    rng = np.random.default_rng(0)
    out.mkdir(parents=True)
    config = CalibrationConfig(dataset="given", keep="all", bootstrap=20, labels=LabelSettings(window=8))
    (out / "config.json").write_text(json.dumps(asdict(config)))
    traces = random_traces(4)
    save_traces(traces, out / "traces.jsonl")
    tokens = 4 * 48
    np.savez_compressed(
        out / "tokens.npz", signal_names=np.array(["raw", "mean", "zscore"]), model=np.array("tiny/calib"),
        signals=rng.normal(size=(3, 4, tokens)), loglik=rng.normal(size=tokens),
        groups=np.repeat(np.arange(4), 48),
    )  # fmt: skip
    (out / "windows.jsonl").write_text("".join(json.dumps({"windows": [[0, 8]]}) + "\n" for _ in traces))
    return out
