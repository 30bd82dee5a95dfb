"""`epikv bench serve` end to end on a tiny model folder: levels, capacity by the pool, targets, figure."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from epikv.bench.serve.clients import summarize_level
from epikv.bench.serve.study import ServeBenchConfig, plot_serve, run_serve
from epikv.bench.shared import documents


def test_summarize_level_by_hand():
    requests = [
        {"arrivals": [0.1, 0.2, 0.4], "usage": {"completion_tokens": 3, "prompt_tokens": 9}},
        {"arrivals": [0.3, 0.4], "usage": {"completion_tokens": 2, "prompt_tokens": 12}},
    ]
    level = summarize_level(requests, wall=2.0)
    assert level["tokens_per_s"] == 2.5 and level["max_prompt_tokens"] == 12
    assert level["ttft_p50_s"] == pytest.approx(0.2)  # between 0.1 and 0.3
    assert level["itl_p99_s"] == pytest.approx(0.1 + 0.98 * 0.1)  # gaps 0.1, 0.1, 0.2


def test_bench_serve_on_a_tiny_model(serve_model_folder, tmp_path):
    config = ServeBenchConfig(
        model=str(serve_model_folder),
        policies=("full", "streaming"),
        budget=128,
        concurrency=(1, 3),
        max_tokens=200,
        pool_requests=1,
        capacity_waves=2,
        threads=1,
        timeout_s=300,
    )
    bars = []

    class Recording(documents.Reporter):
        def bar(self, total: int, desc: str, unit: str = "it"):
            bars.append(super().bar(total, desc, unit))
            return bars[-1]

    document = run_serve(config, reporter=Recording(progress=True))
    assert [(b.desc, b.n, b.total) for b in bars] == [("bench serve", 7, 7)]  # 2x2 levels, 2 pools, 1
    results = document["results"]
    for policy in ("full", "streaming"):
        for c in ("1", "3"):
            level = results["levels"][policy][c]
            assert (
                level["requests"] == int(c) and level["tokens"] == 200 * int(c) and level["tokens_per_s"] > 0
            )
    capacity = results["capacity"]
    pool = capacity["kv_pool"]
    # streaming holds at most K + 1 = 129 slots per request (its prompts are shorter than that); the
    # full cache holds prompt + 200 tokens, and the pool is one such request of the longest prompt
    streaming, full = capacity["policies"]["streaming"], capacity["policies"]["full"]
    assert streaming["max_running"] == streaming["admits"] == pool // 129 >= 2
    assert streaming["requests"] == 2 * streaming["admits"]  # two waves: the pool held the second back
    assert full["max_running"] == full["admits"] == 1 and full["requests"] == 2
    assert "capacity_vs_full_tokens_per_s>=3" in results["targets"]
    described = [s["describe"] for s in document["config"]["cache_specs"]]  # from the servers' logs
    assert described == ["policy=full budget=none interval=1", "policy=streaming budget=128 interval=1"]
    path = documents.write_result(document, tmp_path)
    assert plot_serve(path).stat().st_size > 5000
