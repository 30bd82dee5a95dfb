"""The bench command line (plot from a file) and the GPU script's CPU path on a tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from epikv.bench.cli import KIND_HELP, KINDS
from epikv.bench.shared import documents
from epikv.cli import build_parser, main

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench.py"


def test_every_kind_has_a_command():
    parser = build_parser()
    for kind in ("memory", "speed", "fidelity", "capacity", "peer"):
        args = parser.parse_args(["bench", kind, "--out", "x"])
        assert args.kind == kind
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "capacity", "--out", "x", "--tokens", "3"])  # not a capacity flag


def test_every_kind_has_a_one_line_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for kind, text in KIND_HELP.items():
        assert f"    {kind:<10}{text}\n" in out  # one line at 80 columns, not a docstring
        assert "``" not in text and "document" not in text
    assert set(KIND_HELP) == set(KINDS)


def test_plot_command_redraws_from_the_json(tmp_path, capsys):
    assert main(["bench", "capacity", "--quick", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "[epikv] bench capacity: no cache ran" in err and "bench capacity: 100%" in err
    assert main(["bench", "capacity", "--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    assert "bench capacity: 100%" not in capsys.readouterr().err
    assert documents.read_result(tmp_path / "capacity.json")["config"]["cache_specs"] == []
    (tmp_path / "capacity.png").unlink()
    assert main(["bench", "plot", str(tmp_path / "capacity.json"), "--png", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 5000


def test_gpu_script_cpu_path(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert {"r1-distill-qwen-1.5b", "r1-distill-llama-8b"} <= set(module.CONFIGS)
    assert (
        module.main(
            [
                "--device",
                "cpu",
                "--tiny",
                "--out",
                str(tmp_path),
                "--policies",
                "full,streaming",
                "--extra",
                "8",
                "--max-length",
                "128",
                "--profile-steps",
                "2",
            ]
        )
        == 0
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["run"] for r in summary["runs"]] == ["memory", "speed K=128 + profile"]
    profiled = json.loads((tmp_path / "tiny-llama" / "K128" / "profile.json").read_text())
    assert list(profiled["policies"]) == ["full", "streaming"] and profiled["at"] == [8, 24]
    for windows in profiled["policies"].values():
        assert [len(w["step_ms"]) for w in windows] == [2, 2] and all(w["ops"] > 0 for w in windows)
        assert windows[0]["host_ms"][0][1] > 0  # the op with the most host time ran at least once
    speed = documents.read_result(tmp_path / "tiny-llama" / "K128" / "speed.json", "speed")
    assert speed["results"]["policies"]["streaming"]["within_bound"] is True
    memory = documents.read_result(tmp_path / "tiny-llama" / "memory.json", "memory")
    assert {p["status"] for p in memory["results"]["points"]} == {"ok"}


def test_parts_dir_defaults_beside_the_output_and_can_be_shared(tmp_path):
    from epikv.bench.cli import build_config

    parser = build_parser()
    args = parser.parse_args(["bench", "loops", "--out", str(tmp_path / "new")])
    assert build_config("loops", args).parts_dir == str(tmp_path / "new" / "loops-parts")
    shared = str(tmp_path / "study" / "loops-parts")
    args = parser.parse_args(["bench", "loops", "--out", str(tmp_path / "new"), "--parts-dir", shared])
    assert build_config("loops", args).parts_dir == shared
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "capacity", "--out", "x", "--parts-dir", shared])  # keeps no parts
