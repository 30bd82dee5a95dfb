"""Profiles written by calibration round-trip and are what EpiKV finds; the shipped one is valid."""

from __future__ import annotations

import argparse
import json

import pytest

from epikv.calibrate.cli import QUICK, add_calibrate_parser, config_from_args
from epikv.calibrate.profile import build_profile, write_profile
from epikv.calibrate.stats import choose_bands
from epikv.policies.base import ModelInfo
from epikv.profiles import (
    find_profile,
    install_profile,
    load_profile_file,
    profile_filename,
    user_profile_dir,
)
from epikv.spec import CacheSpec


def _profile(model: str = "org/model-x", layers: int = 6):
    rho = [0.0, 0.3, 0.1, -0.1, -0.4, 0.0]
    choice = choose_bands(rho[:layers], [r - 0.05 for r in rho], [r + 0.05 for r in rho])
    return build_profile(model, layers, choice, "loglik", "zscore", {"dataset": "gsm8k", "n_problems": 3})


def test_round_trip_and_lookup_once_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path / "cache"))
    profile = _profile()
    assert (profile.band_a, profile.band_b) == (1, 4)
    written = write_profile(profile, tmp_path / "run")
    assert written == tmp_path / "run" / "org__model-x.json"
    assert load_profile_file(written) == profile
    assert not user_profile_dir().exists(), "writing a profile must not make it active"
    assert find_profile("org/model-x", 6).method.startswith("scaled")
    install_profile(written)
    found = find_profile("org/model-x", 6)
    assert (found.band_a, found.band_b, found.method) == (profile.band_a, profile.band_b, profile.method)
    assert found.details["installed"] == {
        "from": str(written),
        "forced": False,
        "date": found.details["date"],
    }
    assert found.details["band_a"] == {"layer": 1, "rho": 0.3, "ci": [0.25, 0.3 + 0.05], "near": []}
    assert found.details["dataset"] == "gsm8k" and found.details["label"] == "loglik"
    assert found.method.startswith("epikv calibrate")


def test_shipped_profile_for_the_embedded_model(tmp_path, monkeypatch):
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path / "empty"))
    assert profile_filename("smollm2-135m") == "smollm2-135m.json"
    profile = find_profile("smollm2-135m", 30)
    assert profile.method.startswith("epikv calibrate"), "the shipped calibrated profile is missing"
    assert profile.band_a != profile.band_b
    d = profile.details
    assert d["band_a"]["layer"] == profile.band_a and d["band_b"]["layer"] == profile.band_b
    assert d["n_problems"] >= 20 and d["dataset"] and d["label"] in ("loglik", "flip")
    assert len(d["band_a"]["ci"]) == 2 and d["band_a"]["ci"][0] <= d["band_a"]["rho"] <= d["band_a"]["ci"][1]
    # every EpiKV policy resolves its bands from it (the default, SegQ, needs a layer after Band A)
    info = ModelInfo("smollm2-135m", 30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576)
    for name in ("epikv", "epikv-flat", "epikv-seg"):
        spec = CacheSpec.build(info, name, 256)
        assert (spec.policy.band_a, spec.policy.band_b) == (profile.band_a, profile.band_b)
        assert spec.bands.origin.startswith(("shipped profile", "user profile"))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_calibrate_parser(parser.add_subparsers())
    return parser.parse_args(["calibrate", *argv])


def test_cli_quick_defaults_and_overrides(tmp_path):
    quick = config_from_args(_args("--dataset", "gsm8k", "--quick", "--out", str(tmp_path)))
    assert (quick.limit, quick.max_new_tokens, quick.labels.answer_tokens, quick.bootstrap) == (
        QUICK["limit"], QUICK["max_new_tokens"], QUICK["answer_tokens"], QUICK["bootstrap"],
    )  # fmt: skip
    full = config_from_args(
        _args("--dataset", "math500", "--quick", "--limit", "9", "--label", "flip", "--filler", "random",
              "--marker", "", "--out", str(tmp_path))
    )  # fmt: skip
    assert full.limit == 9 and full.labels.kind == "flip" and full.labels.filler == "random"
    assert full.markers == () and full.dataset == "math500"
    assert json.loads(json.dumps(QUICK)) == QUICK
    with pytest.raises(SystemExit):
        _args("--dataset", "gsm8k", "--label", "kl", "--out", str(tmp_path))
    with pytest.raises(SystemExit):  # the parser itself requires --dataset (or --reuse)
        _args("--out", str(tmp_path))
    with pytest.raises(SystemExit):  # --reuse takes the dataset from the earlier run
        _args("--reuse", "--dataset", "gsm8k", "--out", str(tmp_path))


def test_help_shows_that_a_dataset_is_required(capsys):
    with pytest.raises(SystemExit):
        _args("--help")
    assert "(--dataset DATASET | --reuse)" in " ".join(capsys.readouterr().out.split())
