"""Speed benchmark on a tiny model: the probe's accounting, bounds, ratios, document and figure."""

from __future__ import annotations

import pytest

from epikv.bench.shared import documents, prompt_loading
from epikv.bench.speed import study as speed
from epikv.bench.speed.study import SpeedConfig
from epikv.cli import main


@pytest.fixture(scope="module")
def speed_doc(tiny_pair, short_prompts):
    model, tok = tiny_pair
    config = SpeedConfig(
        policies=("full", "epikv-flat", "streaming", "no-such-policy"),
        budget=64,
        tokens=60,
        repeats=2,
        prompt_source=str(short_prompts),
        prompt_index=0,
        bin_size=16,
    )
    return speed.run_speed(config, model, tok)


def test_probe_times_every_compaction(tiny_pair):
    model, tok = tiny_pair
    ids = prompt_loading.encode_prompt(tok, "Ann has 3 apples and buys 2 more.")
    trace = speed.timed_decode(model, ids, "streaming", 48, 40, interval=4)
    compacting_steps = sum(1 for c in trace.compact_s if c > 0)
    assert trace.compactions == compacting_steps > 0
    assert all(e >= c for e, c in zip(trace.end_step_s, trace.compact_s, strict=True))
    assert len(trace.step_s) == 40 and max(trace.slots) <= 48 + 4


def test_a_timed_decode_asks_for_no_more_tokens_than_the_model_holds(tiny_pair, caplog):
    """The request's cap is the decode length (plus two), not a huge number the engine warns about."""
    model, tok = tiny_pair
    ids = prompt_loading.encode_prompt(tok, "Ann has 3 apples and buys 2 more.")
    with caplog.at_level("WARNING"):
        trace = speed.timed_decode(model, ids, "streaming", 48, 20, interval=4)
    assert len(trace.step_s) == 20
    assert not [r for r in caplog.records if "context" in r.getMessage()]


def test_document_reports_each_policy(speed_doc):
    results = speed_doc["results"]
    assert results["missing_policies"] == ["no-such-policy"]
    assert set(results["policies"]) == {"full", "epikv-flat", "streaming"}
    for name in ("epikv-flat", "streaming"):
        summary = results["policies"][name]
        assert summary["within_bound"] is True and summary["compactions"] > 0
        assert summary["peak_cache_tokens"] <= 64 + summary["interval"]
        assert len(summary["tokens_per_s_repeats"]) == 2
    assert results["policies"]["full"]["peak_cache_tokens"] == results["prompt_tokens"] + 60
    full_mean = results["policies"]["full"]["mean_cache_tokens"]  # held after each of 60 steps, averaged
    assert full_mean == pytest.approx(results["prompt_tokens"] + 30.5)
    assert 0 < results["policies"]["streaming"]["mean_cache_tokens"] <= 65
    assert results["ratios"]["vs_full"]["full"] == 1.0
    assert "vs_h2o" not in results["ratios"]
    specs = {s["policy"]["name"]: s for s in speed_doc["config"]["cache_specs"]}  # each recorded once
    assert len(speed_doc["config"]["cache_specs"]) == 3 and set(specs) == {"full", "epikv-flat", "streaming"}
    bands = specs["epikv-flat"]["bands"]
    assert bands["origin"].startswith("scaled from Llama-8B") and specs["streaming"]["bands"] is None
    assert specs["epikv-flat"]["describe"].endswith(
        f"bands A={bands['band_a']} B={bands['band_b']} ({bands['origin']})"
    )


def test_plot_and_cli(speed_doc, tmp_path, short_prompts, capsys):
    path = documents.write_result(speed_doc, tmp_path)
    assert speed.plot_speed(path).stat().st_size > 5000
    out = tmp_path / "cli"
    code = main(
        [
            "bench",
            "speed",
            "--quick",
            "--model",
            "random:tiny-llama",
            "--prompt-source",
            str(short_prompts),
            "--prompt-index",
            "0",
            "--policies",
            "full,streaming",
            "--budget",
            "48",
            "--tokens",
            "24",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    data = documents.read_result(out / "speed.json", "speed")
    assert data["config"]["repeats"] == 1 and data["config"]["budget"] == 48  # quick preset + overrides
    err = capsys.readouterr().err
    assert "[epikv] policy=streaming budget=48 interval=1" in err.splitlines()
    assert "bench speed: 100%" in err and "48/48" in err  # 2 policies x 24 tokens
    assert (out / "speed.png").exists()


def test_taking_turns_changes_nothing_but_the_timing(tiny_pair):
    model, tok = tiny_pair
    ids = prompt_loading.encode_prompt(tok, "Ann has 3 apples and buys 2 more.")
    config = SpeedConfig(budget=48, tokens=30, chunk=7, interval=3)
    steps = []

    class Bar:
        def update(self, n: int) -> None:
            steps.append(n)

    together = speed.interleaved(model, ids, ["full", "h2o", "epikv-flat"], config, bar=Bar())
    assert steps == [7, 7, 7] * 4 + [2, 2, 2]  # every turn of every policy, 3 x 30 tokens
    for policy, trace in together.items():
        alone = speed.timed_decode(model, ids, policy, 48, 30, interval=3)
        assert trace.slots == alone.slots and trace.compactions == alone.compactions
        assert len(trace.step_s) == 30
    assert model.config._attn_implementation == "sdpa"  # h2o's eager turns were undone


def test_equal_peak_gives_each_policy_its_own_budget(tiny_pair, short_prompts):
    model, tok = tiny_pair
    config = SpeedConfig(
        policies=("full", "streaming", "epikv"), budget=999, peak=200, tokens=200, repeats=1,
        prompt_source=str(short_prompts), prompt_index=0, bin_size=50,
    )  # fmt: skip
    policies = speed.run_speed(config, model, tok)["results"]["policies"]
    assert policies["streaming"]["budget"] == 199 and policies["epikv"]["budget"] == 72  # 200 - tau
    for name in ("streaming", "epikv"):
        assert policies[name]["peak_cache_tokens"] <= 200 and policies[name]["within_bound"]
