"""Band profiles in use: nothing activates a calibrated profile but `epikv profile use`, a weak one
needs --force, and `epikv profile list` / every run say which profile gives the bands and why."""

from __future__ import annotations

import dataclasses
import json

import pytest

from epikv.calibrate.profile import build_profile, write_profile
from epikv.calibrate.stats import choose_bands
from epikv.cli import main
from epikv.policies.base import ModelInfo
from epikv.profiles import (
    load_profile_file,
    locate_profile,
    profile_filename,
    user_profile_dir,
    weak_signal_warnings,
)
from epikv.spec import CacheSpec
from tests.helpers.calibration import reusable_run

SMOL = ModelInfo("smollm2-135m", 30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576)


def _calibrated(rho_a: float, tmp_path, name: str = "run"):
    """A 30-layer smollm2-135m profile as `epikv calibrate` writes it: A = layer 23, B = layer 9,
    with intervals that include 0 when ``rho_a`` is small (the issue's 5-problem quick run)."""
    rho = [0.0] * 30
    rho[23], rho[9] = rho_a, -0.05
    width = 0.02 if rho_a > 0.1 else 0.08
    choice = choose_bands(rho, [r - width for r in rho], [r + width for r in rho])
    profile = build_profile(
        "smollm2-135m", 30, choice, "loglik", "zscore", {"dataset": "gsm8k", "n_problems": 5}
    )
    return write_profile(profile, tmp_path / name)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path / "cache"))


def _listing(capsys, *model: str) -> dict:
    assert main(["profile", "list", "--json", *model]) == 0
    return {entry["model"]: entry for entry in json.loads(capsys.readouterr().out)}


def test_weak_profile_is_refused_then_forced_loudly_then_reset(tmp_path, capsys, empty_cache):
    path = _calibrated(0.01, tmp_path)
    assert any("weak signal" in w for w in weak_signal_warnings(load_profile_file(path)))
    assert main(["profile", "use", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "signal is weak" in err and "--force" in err
    assert not user_profile_dir().exists()
    assert main(["profile", "use", str(path), "--force"]) == 0
    captured = capsys.readouterr()
    assert "WARNING" in captured.err and "weak" in captured.err and "A=23 B=9" in captured.out
    bands = CacheSpec.build(SMOL, "epikv-flat", 256).bands
    assert (bands.band_a, bands.band_b) == (23, 9)
    assert bands.origin == (
        f"user profile {user_profile_dir() / 'smollm2-135m.json'}, over shipped profile smollm2-135m.json, "
        "weak signal"
    )
    entry = _listing(capsys, "smollm2-135m")["smollm2-135m"]
    assert [(r["kind"], r["active"]) for r in entry["profiles"]] == [("user", True), ("shipped", False)]
    assert entry["profiles"][0]["forced"] and entry["profiles"][0]["weak_signal"]
    assert "user profile comes before" in entry["why"]
    assert main(["profile", "reset", "smollm2-135m"]) == 0
    assert "shipped profile smollm2-135m.json" in capsys.readouterr().out
    assert locate_profile("smollm2-135m", 30)[1] == "shipped profile smollm2-135m.json"
    assert main(["profile", "reset", "smollm2-135m"]) == 0
    assert "no user profile" in capsys.readouterr().out


def test_a_clear_profile_installs_without_force(tmp_path, capsys, empty_cache):
    path = _calibrated(0.3, tmp_path)
    assert weak_signal_warnings(load_profile_file(path)) == []
    assert main(["profile", "use", str(path)]) == 0
    assert capsys.readouterr().err == ""
    assert (user_profile_dir() / profile_filename("smollm2-135m")).is_file()
    assert locate_profile("smollm2-135m", 30)[1].endswith("over shipped profile smollm2-135m.json")


def test_list_shows_every_known_model_and_why(capsys, empty_cache):
    entries = _listing(capsys)
    assert {"smollm2-135m", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B"} <= set(entries)
    smol = entries["smollm2-135m"]
    assert [(r["kind"], r["band_a"], r["band_b"]) for r in smol["profiles"]] == [("shipped", 7, 26)]
    assert smol["why"].startswith("no user profile")
    llama = entries["deepseek-ai/DeepSeek-R1-Distill-Llama-8B"]["profiles"]
    assert [(r["kind"], r["band_a"], r["band_b"]) for r in llama] == [("paper", 10, 21)]
    assert main(["profile", "list"]) == 0
    text = capsys.readouterr().out
    assert "  * A=7 B=26 of 30 layers  shipped profile smollm2-135m.json" in text
    assert "scaled by depth" in text


def test_a_broken_profile_file_is_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x"}')
    assert main(["profile", "use", str(bad)]) == 2
    assert "is not an EpiKV band profile" in capsys.readouterr().err


def test_calibrate_writes_only_its_run_folder(tmp_path, capsys, empty_cache):
    """The issue's scenario without a model: --reuse redoes the statistics and writes the profile."""
    out = reusable_run(tmp_path / "run")
    assert main(["calibrate", "--reuse", "--no-progress", "--out", str(out)]) == 0
    text, err = capsys.readouterr()
    assert "calibrate:" not in err  # --no-progress
    assert not user_profile_dir().exists()
    assert f"`epikv profile use {out / 'tiny__calib.json'}`" in text and "not in use" in text


def test_generate_says_which_bands_it_uses(tmp_path, capsys, monkeypatch):
    import epikv.profiles

    home = tmp_path / "profiles"  # the embedded model stays in the real cache; only profiles move
    monkeypatch.setattr(epikv.profiles, "user_profile_dir", lambda: home)
    argv = ["generate", "--policy", "epikv-flat", "--budget", "64", "--max-new-tokens", "2", "Hi"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    line = "[epikv] policy=epikv-flat budget=64 interval=1 bands A=7 B=26 (shipped profile smollm2-135m.json)"
    assert line in captured.err.splitlines()
    report = json.loads(captured.out)
    assert report["bands"] == {"band_a": 7, "band_b": 26, "origin": "shipped profile smollm2-135m.json"}
    main(["profile", "use", "--force", str(_calibrated(0.01, tmp_path))])
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"bands A=23 B=9 (user profile {home / 'smollm2-135m.json'}, over shipped profile" in err


def test_spec_records_bands_with_origin():
    spec = CacheSpec.build(SMOL, "epikv", 256)
    assert dataclasses.asdict(spec.bands) == spec.config()["bands"]
    assert spec.config()["bands"]["origin"] == "shipped profile smollm2-135m.json"
