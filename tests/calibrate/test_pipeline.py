"""A whole calibration run on a tiny random model: files, profile lookup, plot from JSON alone."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from epikv.calibrate.analysis import scaled_bands, within_problem_rho
from epikv.calibrate.occlusion import LabelSettings
from epikv.calibrate.pipeline import (
    CalibrationConfig,
    config_from_file,
    obtain_traces,
    run_calibration,
    select_traces,
)
from epikv.calibrate.plot import plot_rho
from epikv.calibrate.traces import load_traces, save_traces
from epikv.models import set_identity
from epikv.profiles import (
    find_profile,
    install_profile,
    scaled_profile,
    user_profile_dir,
    weak_signal_warnings,
)
from tests.helpers.calibration import random_traces
from tests.helpers.models import make_tiny


@pytest.fixture
def named_tiny():
    model = make_tiny("llama", seed=1)
    set_identity(model, "tiny/calib")
    return model


def test_run_writes_everything_and_epikv_finds_the_profile(tmp_path, monkeypatch, named_tiny, tok, capsys):
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path / "cache"))
    save_traces(random_traces(4), tmp_path / "given.jsonl")
    config = CalibrationConfig(
        dataset="given", traces=str(tmp_path / "given.jsonl"), keep="all", bootstrap=30,
        labels=LabelSettings(kind="flip", window=8, stride=4, answer_tokens=6), rolling=8,
    )  # fmt: skip
    out = tmp_path / "run"
    result = run_calibration(config, out, model=named_tiny, tokenizer=tok, progress=True)
    err = capsys.readouterr().err
    assert "calibrate: labels: 100%" in err and "4/4" in err and "calibrate: analysis: 100%" in err
    for name in (
        "config.json",
        "traces.jsonl",
        "windows.jsonl",
        "tokens.npz",
        "rho.json",
        "tiny__calib.json",
    ):
        assert (out / name).is_file(), name
    rho = json.loads((out / "rho.json").read_text())
    assert set(rho["labels"]) == {"loglik", "flip"}
    assert len(rho["labels"]["loglik"]["signals"]["zscore"]["rho"]) == 4
    assert rho["n_problems"] == 4 and rho["bootstrap"]["unit"] == "problem"
    assert len(rho["labels"]["flip"]["signals"]["raw"]["rho_within"]) == 4
    assert set(rho["score"]["flip"]) == {"chosen", "scaled_default"}
    assert result.path == out / "tiny__calib.json" and not user_profile_dir().exists()
    assert find_profile("tiny/calib", 4).method.startswith("scaled"), "calibration changed the bands in use"
    install_profile(result.path, force=True)  # four random traces: a weak signal
    found = find_profile("tiny/calib", 4)
    assert found.details.pop("installed")["forced"] == bool(weak_signal_warnings(found))
    assert found == result.profile
    assert (found.band_a, found.band_b) == (rho["choice"]["band_a"], rho["choice"]["band_b"])
    details = found.details
    assert details["dataset"] == "given" and details["label"] == "flip" and details["signal"] == "zscore"
    assert details["n_problems"] == 4 and details["n_windows"] == 4 * 11 and details["window"] == 8
    assert details["band_a"]["rho"] == pytest.approx(rho["choice"]["rho_a"])
    assert {"date", "epikv_version", "warnings"} <= set(details)
    again = run_calibration(config_from_file(out / "config.json"), out, reuse=True)  # no model given
    assert again.rho["labels"] == rho["labels"] and again.profile == result.profile
    raw = run_calibration(replace(config, signal="raw"), out, reuse=True)
    assert raw.rho["choice"]["signal"] == "raw" and raw.rho["reused"]
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(out / "rho.json", alone / "rho.json")
    assert plot_rho(alone / "rho.json", alone / "rho.png").stat().st_size > 1000


def test_select_traces():
    traces = random_traces(4)
    traces[1].finished = False
    traces[2].answer = None
    traces[3].answer_start = traces[3].prompt_len + 3
    assert [t.id for t in select_traces(traces, "answered", 8)] == ["p0"]
    assert [t.id for t in select_traces(traces, "correct", 8)] == ["p0", "p2"]
    assert [t.id for t in select_traces(traces, "all", 8)] == ["p0", "p1", "p2"]


@pytest.mark.parametrize("layers", [30, 32, 28, 4])
def test_scaled_bands_are_the_cores_fallback(layers):
    core = scaled_profile("x", layers)
    assert scaled_bands(layers) == {"band_a": core.band_a, "band_b": core.band_b}


def test_config_is_validated():
    with pytest.raises(ValueError, match="keep"):
        CalibrationConfig(keep="some")
    with pytest.raises(ValueError, match="signal"):
        CalibrationConfig(signal="ema")


def test_within_problem_rho_averages_problems_and_skips_constant_labels():
    x = np.tile(np.arange(5.0), 3)
    y = np.concatenate([np.arange(5.0), np.arange(5.0) ** 2, np.zeros(5)])
    got = within_problem_rho(np.stack([x, -x]), y, np.repeat([0, 1, 2], 5))
    assert got.tolist() == pytest.approx([1.0, -1.0])
    y[5:10] = -np.arange(5.0)
    assert within_problem_rho(x[None], y, np.repeat([0, 1, 2], 5)).tolist() == pytest.approx([0.0])


def test_given_traces_are_sliced_and_copied(tmp_path):
    save_traces(random_traces(5), tmp_path / "given.jsonl")
    config = CalibrationConfig(traces=str(tmp_path / "given.jsonl"), offset=1, limit=2)
    got = obtain_traces(config, None, None, tmp_path / "run")
    assert [t.id for t in got] == ["p1", "p2"]
    assert [t.id for t in load_traces(tmp_path / "run" / "traces.jsonl")] == ["p1", "p2"]


def test_traces_phase_has_a_bar(tmp_path, monkeypatch, capsys):
    from epikv.calibrate import pipeline

    def fake_generate(model, tokenizer, problems, *args, on_batch, **kwargs):
        for done in (2, len(problems)):  # two batches
            on_batch(done)
        return random_traces(len(problems))

    monkeypatch.setattr(pipeline, "generate_traces", fake_generate)
    config = CalibrationConfig(dataset="gsm8k", limit=3)
    assert len(obtain_traces(config, None, None, tmp_path, progress=True)) == 3
    assert "calibrate: traces: 100%" in capsys.readouterr().err
    obtain_traces(config, None, None, tmp_path)
    assert "calibrate:" not in capsys.readouterr().err


def test_reuse_needs_an_earlier_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="reuse"):
        run_calibration(CalibrationConfig(), tmp_path, reuse=True)
