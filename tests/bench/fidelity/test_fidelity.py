"""Fidelity study: detectors, per-position metrics, equal-peak cells, resumable runs, the summary."""

from __future__ import annotations

import json
import math

import pytest
import torch

from epikv.bench.fidelity import study as fidelity
from epikv.bench.fidelity.study import FidelityConfig
from epikv.bench.fidelity.summary import comparison_table, summarize_fidelity
from epikv.bench.shared import documents, prompt_loading
from epikv.cli import main
from epikv.integration import build_spec


def test_parse_variant():
    assert fidelity.parse_variant("epikv-flat:band_a=9:band_b=20") == (
        "epikv-flat",
        {"band_a": "9", "band_b": "20"},
    )
    assert fidelity.parse_variant("streaming") == ("streaming", {})
    with pytest.raises(ValueError, match="not key=value"):
        fidelity.parse_variant("epikv:fill")


def test_recorder_metrics_by_hand():
    """Four positions over a 3-token vocabulary; the cache evicted before positions 2 and 3."""
    full = torch.log_softmax(
        torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0], [2.0, 1.0, 0.0]]), -1
    )
    trace = [0, 1, 1, 0]
    recorder = fidelity._Recorder(full, trace, prompt_tokens=4)
    logits = [full[0], full[1], torch.tensor([0.0, 3.0, 0.0]), torch.tensor([0.0, 0.0, 0.0])]
    for index, (row, evicted) in enumerate(zip(logits, [False, False, True, True], strict=True)):
        recorder(index, row, evicted)
    got = recorder.metrics(tail=1)
    uniform = torch.full((3,), -math.log(3))
    kl2 = float((full[2].exp() * (full[2] - torch.log_softmax(logits[2], -1))).sum())
    kl3 = float((full[3].exp() * (full[3] - uniform)).sum())
    # argmax of uniform logits is token 0, which agrees with position 3's reference
    assert (
        got["agreement"] == 0.75 and got["agreement_after_eviction"] == 0.5 and got["agreement_tail"] == 1.0
    )
    assert got["kl_after_eviction"] == pytest.approx((kl2 + kl3) / 2) and got["kl"] == pytest.approx(
        (kl2 + kl3) / 4
    )
    assert got["kl_tail"] == pytest.approx(kl3)
    nll2 = float(-torch.log_softmax(logits[2], -1)[1])
    assert got["nll_after_eviction"] == pytest.approx((nll2 + math.log(3)) / 2)
    assert got["full_nll_after_eviction"] == pytest.approx(float(-(full[2, 1] + full[3, 0]) / 2))
    assert got["first_eviction_step"] == 2 and got["kept_histogram"] is None


def test_recorder_kept_positions():
    """Pooled over layers and heads, holes (-1) dropped, at most one compaction per ``every``."""
    recorder = fidelity._Recorder(torch.zeros(1, 2), [0], prompt_tokens=4, bins=4, every=8)
    positions = torch.tensor([[[0, 1, 10, 11]], [[-1, 0, 6, 11]]])  # 2 layers, sequence of 12
    recorder.on_compaction(8, positions)
    recorder.on_compaction(9, torch.zeros(2, 1, 4, dtype=torch.long))  # within 8 tokens: ignored
    got = recorder.metrics(tail=1)
    # relative ages p / 11 of 0,1,10,11,0,6,11 -> bins 0,0,3,3,0,2,3
    assert got["kept_histogram"] == pytest.approx([3 / 7, 0, 1 / 7, 3 / 7], abs=1e-5)
    assert got["kept_prompt_share"] == pytest.approx(3 / 7)


def test_equal_peak_cells_hold_the_same_peak(tiny_pair):
    """K = peak - tau per policy; teacher forced, each cell's measured peak is the target."""
    model, tok = tiny_pair
    config = FidelityConfig(
        policies=("streaming", "epikv-flat:band_a=1:band_b=2:interval=16", "epikv"),
        budgets=(40,),
        peaks=(64,),
    )
    specs, plan = fidelity.plan_cells(model, config)
    matched = {(e["label"].split(":")[0], e["kind"]): e["budget"] for e in plan}
    assert matched[("streaming", "peak")] == 63 and matched[("epikv-flat", "peak")] == 48
    assert matched[("epikv", "peak")] is None  # tau = 128 leaves no budget under a peak of 64
    assert "tau 128" in next(e["why"] for e in plan if e["budget"] is None)
    ids = [prompt_loading.prompt_token_ids(tok, "Ann has 3 apples.")]
    traced = fidelity.full_traces(model, ids, 80)
    for name in ("streaming@63", "epikv-flat:band_a=1:band_b=2:interval=16@48"):
        (got,) = fidelity.teacher_force(model, ids, [traced[0][0]], [traced[0][1]], specs[name])
        assert got["peak_cache_tokens"] == 64 and got["mean_cache_tokens"] < 64


def test_teacher_forcing_without_eviction_matches_the_trace(tiny_pair):
    model, tok = tiny_pair
    ids = [
        prompt_loading.prompt_token_ids(tok, "Ann has 3 apples."),
        prompt_loading.prompt_token_ids(tok, "Bo has 12 pears."),
    ]
    traced = fidelity.full_traces(model, ids, 20)
    traces, refs = [t for t, _ in traced], [r for _, r in traced]
    assert refs[0].shape == (20, model.config.vocab_size)
    spec = build_spec(model, "streaming", 10_000)
    for same in fidelity.teacher_force(model, ids, traces, refs, spec):
        assert same["agreement"] == 1.0 and same["kl"] == pytest.approx(0.0, abs=1e-5)
        assert same["first_eviction_step"] is None and same["agreement_after_eviction"] is None
    # forcing the full cache's own trace reproduces its log-probabilities
    again = fidelity.forced_references(model, ids, traces)
    torch.testing.assert_close(again[0][1], refs[0], atol=1e-4, rtol=1e-4)
    cuts = fidelity.teacher_force(model, ids, traces, refs, build_spec(model, "streaming", 12))
    for prompt, cut in zip(ids, cuts, strict=True):
        assert cut["first_eviction_step"] is not None and cut["kl"] > 1e-6
        assert cut["peak_cache_tokens"] == max(len(prompt), 12 + 1)  # the prompt, or K + tau
        assert cut["kept_histogram"] is not None and sum(cut["kept_histogram"]) == pytest.approx(1, abs=1e-4)


def _prompt(genre: str, a: float, b: float) -> dict:
    def cell(v):
        return {
            "agreement_tail": v,
            "agreement": v,
            "kl_tail": 1 - v,
            "nll_tail": 1.0,
            "peak_cache_tokens": 9,
        }

    cells = {"streaming@8": cell(a), "x@1": cell(b)}
    return {
        "genre": genre,
        "trace_tokens": 10,
        "full_nll": 1.0,
        "full_nll_tail": 1.0,
        "full_loop_period": None,
        "cells": cells,
    }


def test_summary_pairs_prompts_and_lists_unmatched_peaks():
    prompts = [_prompt("g1", 0.5 + i / 100, 0.6 + i / 100) for i in range(8)] + [_prompt("g2", 0.7, 0.7)]
    plan = [
        {"label": "streaming", "kind": "peak", "target": 9, "budget": 8, "cell": "streaming@8"},
        {"label": "x", "kind": "peak", "target": 9, "budget": 1, "cell": "x@1"},
        {"label": "y", "kind": "peak", "target": 9, "budget": None, "why": "tau too large"},
    ]
    config = FidelityConfig(peaks=(9,), budgets=())
    summary = summarize_fidelity(prompts, plan, config)
    assert summary["genres"] == ["g1", "g2", "all"]
    row = summary["rows"]["g1"]["x@1"]
    assert row["prompts"] == 8 and row["agreement_tail"][0] == pytest.approx(0.635)
    (comparison,) = summary["comparisons"]
    x = next(i for i in comparison["genres"]["g1"] if i["label"] == "x")
    assert x["vs_reference"]["agreement_tail"] == pytest.approx([0.1, 0.1, 0.1])  # every pair differs by 0.1
    table = comparison_table(summary, "peak", 9, "g1")
    assert (
        "| x | 1 | 0.635" in table
        and "0.100 [0.100, 0.100] *" in table
        and "cannot match: tau too large" in table
    )


@pytest.fixture(scope="module")
def genre_run(tiny_pair, tmp_path_factory):
    model, tok = tiny_pair
    folder = tmp_path_factory.mktemp("fidelity")
    config = FidelityConfig(
        genres=("prose", "gsm8k-greedy"),
        prompts=2,
        prompt_tokens=24,
        trace_tokens=40,
        policies=("streaming", "epikv-flat:band_a=1:band_b=2"),
        budgets=(48,),
        peaks=(49,),
        tail_tokens=8,
        batch_size=3,
        parts_dir=str(folder / "parts"),
    )
    return config, fidelity.run_fidelity(config, model, tok), folder


def test_genre_run_is_resumable(genre_run, tiny_pair, monkeypatch):
    config, document, folder = genre_run
    results = document["results"]
    assert [p["genre"] for p in results["prompts"]] == ["prose", "prose", "gsm8k-greedy", "gsm8k-greedy"]
    greedy = results["prompts"][2]["cells"]["streaming@48"]
    assert "first_divergence" in greedy and "loop_period" in greedy  # free running on a generated genre
    assert "loop_period" not in results["prompts"][0]["cells"]["streaming@48"]  # not on forced text
    assert {e["cell"] for e in results["plan"]} == {"streaming@48", "epikv-flat:band_a=1:band_b=2@48"}
    parts = sorted(p.relative_to(folder / "parts").as_posix() for p in (folder / "parts").rglob("*.json"))
    assert len(parts) == 6 and parts[0].startswith("b00/")  # 2 batches x (full + 2 cells)
    assert "load_average" in json.loads((folder / "parts" / parts[0]).read_text())
    specs = document["config"]["cache_specs"]  # every spec the run used, with its bands' origin
    assert sorted(s["policy"]["name"] for s in specs) == ["epikv-flat", "streaming"]
    assert all(s["budget"] == 48 and s["describe"] for s in specs)

    def no_compute(*args, **kwargs):
        raise AssertionError("a finished part was recomputed")

    monkeypatch.setattr(fidelity, "_run_cell", no_compute)
    monkeypatch.setattr(fidelity, "_reference", no_compute)
    again = fidelity.run_fidelity(config, *tiny_pair)
    assert again["results"]["prompts"] == results["prompts"]


def test_plot_and_cli(genre_run, tmp_path, short_prompts, capsys):
    _, document, _ = genre_run
    path = documents.write_result(document, tmp_path)
    assert fidelity.plot_fidelity(path).stat().st_size > 5000
    assert (tmp_path / "fidelity-kept.png").stat().st_size > 5000
    capsys.readouterr()
    assert main(["bench", "table", str(path), "--genres", "prose"]) == 0
    table = capsys.readouterr().out
    assert "#### prose, equal K = 48" in table and "#### prose, equal peak memory = 49" in table
    assert table.count("| streaming | 48 |") == 2 and "gsm8k-greedy" not in table  # K 48 = peak 49
    assert main(["bench", "table", str(path), "--genres", "poetry"]) == 2
    assert "--genres poetry: the result has prose, gsm8k-greedy, all" in capsys.readouterr().err
    assert main(["bench", "table", str(path), "--datasets", "prose"]) == 2
    assert "a fidelity result is split by genres; give --genres" in capsys.readouterr().err
    code = main(
        [
            "bench",
            "fidelity",
            "--quick",
            "--model",
            "random:tiny-llama",
            "--prompt-source",
            str(short_prompts),
            "--prompt-offset",
            "0",
            "--trace-tokens",
            "12",
            "--policies",
            "streaming",
            "--budgets",
            "32",
            "--out",
            str(tmp_path / "cli"),
        ]
    )
    assert code == 0
    assert "bench fidelity: 100%" in capsys.readouterr().err  # the full trace and streaming@32
    data = documents.read_result(tmp_path / "cli" / "fidelity.json", "fidelity")
    assert data["results"]["summary"]["rows"][str(short_prompts)]["streaming@32"]["prompts"] == 1
    assert (tmp_path / "cli" / "fidelity-parts" / "b00").is_dir()
