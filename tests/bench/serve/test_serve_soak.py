"""`epikv bench serve --soak` on a tiny model folder: every client accounted for, none lost."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from epikv.bench.serve.soak import OUTCOMES, kind_of
from epikv.bench.serve.study import ServeBenchConfig, plot_serve, run_serve


def test_soak_accounts_for_every_client(serve_model_folder, tmp_path):
    config = ServeBenchConfig(model=str(serve_model_folder), policies=("streaming",), budget=64,
                              max_tokens=24, threads=1, soak_s=4.0, soak_rows=3)  # fmt: skip
    document = run_serve(config)
    soak = document["results"]["soak"]
    bursts, totals = soak["bursts"], soak["totals"]
    assert len(bursts) >= 1 and all(sum(b[o] for o in OUTCOMES) == 6 for b in bursts)
    kinds = [kind_of(i) for i in range(6 * len(bursts))]
    assert totals["4xx"] == kinds.count("malformed")  # refused before the queue: never a 429
    assert totals["completed"] + totals["429"] + totals["left"] == len(kinds) - kinds.count("malformed")
    assert totals["left"] <= kinds.count("leave") and totals["completed"] >= 1
    assert totals["lost"] == totals["5xx"] == 0
    assert soak["gauges_zero_after_every_burst"] and soak["server_alive"]
    assert not soak["traceback_in_server_log"]
    assert all(b["rss_mb"] > 0 for b in bursts)

    path = tmp_path / "serve.json"
    path.write_text(json.dumps(document))
    assert plot_serve(path).exists()
