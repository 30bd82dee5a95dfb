"""Fidelity benchmark: loop and divergence detectors, teacher forcing, the document and its figure."""

from __future__ import annotations

import pytest

from epikv.bench import fidelity, io
from epikv.bench.fidelity import FidelityConfig
from epikv.cli import main
from epikv.integration import build_spec


def test_repeated_suffix():
    assert fidelity.repeated_suffix([5, 6, 7] + [1, 2] * 20, max_period=8, min_span=16) == 2
    assert fidelity.repeated_suffix([9] * 40, min_span=16) == 1
    assert fidelity.repeated_suffix(list(range(60)), min_span=16) is None
    assert fidelity.repeated_suffix([1, 2] * 4, min_span=16) is None  # too short to call a loop


def test_first_divergence():
    assert fidelity.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert fidelity.first_divergence([1, 2, 3], [1, 2, 3]) is None


def test_teacher_forcing_without_eviction_matches_the_trace(tiny_pair):
    model, tok = tiny_pair
    ids = [io.encode_prompt_ids(tok, "Ann has 3 apples."), io.encode_prompt_ids(tok, "Bo has 12 pears.")]
    traced = fidelity.full_traces(model, ids, 20)
    traces, refs = [t for t, _ in traced], [r for _, r in traced]
    assert refs[0].shape == (20, model.config.vocab_size)
    spec = build_spec(model, "streaming", 10_000)
    for same in fidelity.teacher_force(model, ids, traces, refs, spec):
        assert same["agreement"] == 1.0 and same["kl"] == pytest.approx(0.0, abs=1e-5)
        assert same["first_eviction_step"] is None and same["agreement_after_eviction"] is None
    cuts = fidelity.teacher_force(model, ids, traces, refs, build_spec(model, "streaming", 12))
    for prompt, cut in zip(ids, cuts, strict=True):
        assert cut["first_eviction_step"] is not None and cut["kl"] > 1e-6
        assert cut["peak_cache_tokens"] == max(len(prompt), 12 + 1)  # the prompt, or K + tau


@pytest.fixture(scope="module")
def fidelity_doc(tiny_pair, short_prompts):
    model, tok = tiny_pair
    config = FidelityConfig(
        prompt_source=str(short_prompts),
        prompts=2,
        trace_tokens=24,
        policies=("epikv-flat", "streaming"),
        budgets=(40, 56),
    )
    return fidelity.run_fidelity(config, model, tok)


def test_document_skips_budgets_that_cannot_hold_the_prompt(fidelity_doc):
    results = fidelity_doc["results"]
    assert len(results["prompts"]) == 2
    rows = {(r["policy"], r["budget"]): r for r in results["summary"]["rows"]}
    assert set(rows) == {(p, k) for p in ("epikv-flat", "streaming") for k in (40, 56)}
    assert rows[("epikv-flat", 40)]["skipped"] == 2  # ~45-token prompts + recent window > 40
    assert rows[("streaming", 40)]["skipped"] == 0  # streaming protects only its sinks
    specs = fidelity_doc["config"]["cache_specs"]
    assert [(s["policy"]["name"], s["budget"]) for s in specs] == sorted(rows)
    assert specs[0]["bands"]["origin"].startswith("scaled from Llama-8B") and specs[0]["describe"]
    for row in rows.values():
        if row["prompts"]:
            assert 0.0 <= row["agreement"] <= 1.0 and row["kl"] >= 0.0 and row["loop_rate"] is not None


def test_plot_and_cli(fidelity_doc, tmp_path, short_prompts, capsys):
    path = io.write_result(fidelity_doc, tmp_path)
    assert fidelity.plot_fidelity(path).stat().st_size > 5000
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
    data = io.read_result(tmp_path / "cli" / "fidelity.json", "fidelity")
    assert data["results"]["summary"]["rows"][0]["prompts"] == 1
