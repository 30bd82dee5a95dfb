"""``--rank-every N`` on the bench kinds that run a policy at a budget (issue 56): the flag lands in
each kind's config, reaches every spec the kind builds (tau = 1, an equal peak is K + 1), gives its
cells names of their own, and is recorded in the document; the accuracy study's cells ranked every
rho steps are cells of their own (name and folder), the study's own cells unchanged."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from epikv.bench import cli as bench_cli
from epikv.bench.accuracy.design import Study
from epikv.bench.fidelity import study as fidelity
from epikv.bench.loops import study as loops
from epikv.bench.serve import study as serve
from epikv.bench.speed import study as speed
from epikv.cli import build_parser, main
from epikv.eval.config import run_dir

RANKED_KINDS = ("step", "speed", "fidelity", "loops", "serve")


@pytest.mark.parametrize("kind", RANKED_KINDS)
def test_the_flag_lands_in_the_kind_config(kind, tmp_path):
    args = build_parser().parse_args(["bench", kind, "--out", str(tmp_path), "--rank-every", "8"])
    assert bench_cli.build_config(kind, args).rank_every == 8
    plain = build_parser().parse_args(["bench", kind, "--out", str(tmp_path)])
    assert bench_cli.build_config(kind, plain).rank_every is None


@pytest.mark.parametrize("kind", ("speed", "fidelity", "loops"))
def test_a_kind_refuses_rank_every_beside_another_interval(kind, tmp_path):
    args = build_parser().parse_args(
        ["bench", kind, "--out", str(tmp_path), "--rank-every", "8", "--interval", "4"]
    )
    with pytest.raises(ValueError, match="needs interval 1, got interval=4 with rank_every=8"):
        bench_cli.build_config(kind, args)


def test_a_quick_step_run_ranks_every_rho_steps_and_records_it(tmp_path, capsys):
    argv = [
        "bench",
        "step",
        "--quick",
        "--model",
        "random:tiny-llama",
        "--dtypes",
        "float32",
        "--rank-every",
        "8",
    ]
    assert main([*argv, "--no-progress", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "step.json").read_text())
    assert document["config"]["rank_every"] == 8
    ranked = [s for s in document["config"]["cache_specs"] if s["budget"] is not None]
    assert [(s["budget"], s["interval"], s["rank_every"]) for s in ranked] == [(384 - 1, 1, 8)]
    for cell in document["results"]["cells"]:
        if cell["policy"] == "full":
            assert "rank_every" not in cell and cell["compact_ms"] is None
            continue
        assert (cell["budget"], cell["interval"], cell["rank_every"]) == (383, 1, 8)
        assert cell["step_ms_with_compaction"] == pytest.approx(cell["step_ms"] + cell["compact_ms"] / 8)
    assert "rank_every=8" in capsys.readouterr().err


def test_speed_decodes_at_k_plus_one_and_an_equal_peak_is_k_plus_one(tiny_pair):
    model = tiny_pair[0]
    config = speed.SpeedConfig(policies=("lagkv",), budget=32, tokens=40, rank_every=8, chunk=8, warmup=1)
    ids = torch.arange(1, 25).unsqueeze(0)
    trace = speed.interleaved(model, ids, ["lagkv"], config)["lagkv"]
    assert (trace.interval, trace.peak_cache_tokens) == (1, 32 + 1)  # lagkv's own tau is 128
    assert speed.budget_of(dataclasses.replace(config, peak=320), "lagkv") == 319
    assert speed.budget_of(dataclasses.replace(config, peak=320, rank_every=None), "lagkv") == 320 - 128


def test_fidelity_cells_ranked_every_rho_are_named_apart(tiny_pair):
    config = fidelity.FidelityConfig(
        policies=("lagkv", "streaming"), budgets=(40,), peaks=(64,), rank_every=8
    )
    specs, plan = fidelity.plan_cells(tiny_pair[0], config)
    assert sorted(specs) == ["lagkv@40 rho=8", "lagkv@63 rho=8", "streaming@40 rho=8", "streaming@63 rho=8"]
    assert {(s.interval, s.rank_every) for s in specs.values()} == {(1, 8)}
    assert {(e["label"], e["target"]): e["cell"] for e in plan}[("lagkv", 64)] == "lagkv@63 rho=8"
    plain, _ = fidelity.plan_cells(tiny_pair[0], dataclasses.replace(config, rank_every=None))
    assert sorted(plain) == ["lagkv@40", "streaming@40", "streaming@63"]  # lagkv: tau 128 > 64


def test_loops_cells_ranked_every_rho_are_named_apart(tiny_pair):
    config = loops.QUICK
    specs, plan = loops.plan_cells(
        tiny_pair[0], dataclasses.replace(config, policies=("full", "lagkv"), rank_every=8)
    )
    assert list(specs) == ["full", "lagkv@127 rho=8"]
    assert (specs["lagkv@127 rho=8"].interval, specs["lagkv@127 rho=8"].rank_every) == (1, 8)
    assert specs["full"].rank_every is None
    assert [e.get("cell") for e in plan] == ["full", "lagkv@127 rho=8"]


def test_serve_starts_every_server_and_generate_with_rank_every(monkeypatch, tmp_path):
    started: list[list[str]] = []

    class Process:
        def __init__(self, argv, **_):
            started.append(argv)

    monkeypatch.setattr(serve.subprocess, "Popen", Process)
    config = dataclasses.replace(serve.QUICK, rank_every=8)
    serve.start_server(config, "streaming", None, tmp_path)
    serve.start_server(dataclasses.replace(config, rank_every=None), "streaming", None, tmp_path)
    assert started[0][started[0].index("--rank-every") + 1] == "8" and "--rank-every" not in started[1]

    def run(argv, **_):
        started.append(argv)
        return type("Done", (), {"stdout": '{"tokens_per_second": 1.0}'})()

    monkeypatch.setattr(serve.subprocess, "run", run)
    serve.generate_speed(config, "hi")
    assert started[-1][started[-1].index("--rank-every") + 1] == "8"


def test_accuracy_cells_ranked_every_rho_have_their_own_name_and_folder():
    study = Study()
    names = [c.name for c in study.cells()]
    assert "gsm8k/keydiff@K319" in names and not any("rho" in n for n in names)  # the study's own cells
    plain, ranked = study.find("gsm8k/keydiff@K319"), study.find("gsm8k/keydiff@K319 rho=128")
    assert ranked.name == "gsm8k/keydiff@K319 rho=128" and ranked.rank_every == 128
    assert dataclasses.replace(ranked, rank_every=None) == plain
    plain_config = plain.config("results/accuracy", study.model, study.dtype)
    ranked_config = ranked.config("results/accuracy", study.model, study.dtype)
    assert plain_config.rank_every is None and ranked_config.rank_every == 128
    assert run_dir(plain_config, "gsm8k-shuffle0") == Path("results/accuracy/gsm8k-shuffle0/keydiff/K319")
    assert run_dir(ranked_config, "gsm8k-shuffle0") == Path(
        "results/accuracy/rho128/gsm8k-shuffle0/keydiff/K319"
    )
    for wrong in ("gsm8k/full@full rho=8", "gsm8k/keydiff@K320 rho=8", "gsm8k/keydiff@K319 rho=often"):
        with pytest.raises(ValueError, match="no cell"):
            study.find(wrong)
