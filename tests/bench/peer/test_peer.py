"""Peer comparison: the kvpress runner stays self-contained, kept-set replays, our worker, the figure."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json

import torch

from epikv.bench.peer import study as peer
from epikv.bench.peer.study import PeerConfig
from epikv.bench.shared import documents, model_loading


def _runner():
    spec = importlib.util.spec_from_file_location("kvpress_runner", peer.RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runner_imports_nothing_of_epikv():
    tree = ast.parse(peer.RUNNER.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= {
        "__future__",
        "argparse",
        "json",
        "sys",
        "time",
        "pathlib",
        "torch",
        "transformers",
        "kvpress",
    }


def test_runner_replays_the_schedule_by_position():
    runner = _runner()

    def stream(held, k):
        return held[:2] + held[len(held) - (k - 2) :]

    # prompt 4, 10 decode steps, compress every 4 steps to 6 tokens: at steps 4 and 8
    assert runner.defined_positions(4, 10, 6, 4, stream) == [0, 1, 8, 9, 10, 11, 12, 13]
    keys = torch.randn(20, 8)
    got, worst = runner.recover_positions(keys[[3, 7, 1]] + 1e-4, keys)
    assert got == [1, 3, 7] and worst < 1e-2


def test_our_streaming_schedule():
    # compacts at step 3 (7 > 6 held, 5 steps since) and step 5 (2 steps later), not at step 4
    assert peer.expected_streaming(4, 6, 6, 2, 2) == [0, 1, 5, 6, 7, 8, 9]
    assert len(peer.expected_streaming(50, 0, 20, 8, 4)) == 20  # an over-budget prompt compacts at once


def test_worker_keeps_what_streaming_defines(tmp_path, capsys):
    model = model_loading.random_model("tiny-llama")
    model.save_pretrained(tmp_path / "m")
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(2, 12))))
    args = [
        "--model",
        str(tmp_path / "m"),
        "--ids",
        str(ids),
        "--policy",
        "streaming",
        "--budget",
        "16",
        "--interval",
        "4",
        "--tokens",
        "20",
        "--threads",
        "1",
    ]
    assert peer.worker_main(args) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["kept_set"] == {"checked": True, "all_match": True}
    assert report["peak_cache_tokens"] <= 16 + 4 and report["tokens_per_s"] > 0


def test_compare_and_plot(tmp_path):
    rows = [
        {"side": "kvpress", "method": "streaming", "tokens_per_s": 10.0, "peak_bytes": 2e6},
        {"side": "kvpress", "method": "knorm", "tokens_per_s": 20.0, "peak_bytes": 2e6},
        {"side": "epikv", "method": "streaming", "tokens_per_s": 15.0, "peak_bytes": 1e6},
        {"side": "epikv", "method": "epikv", "tokens_per_s": 10.0, "peak_bytes": 1e6},
    ]
    comparison = peer.compare(rows)
    assert comparison["pairs"]["streaming/streaming"] == {"tokens_per_s_ratio": 1.5, "peak_ratio": 0.5}
    assert comparison["vs_fastest_press"] == {"streaming": 0.75, "epikv": 0.5}
    doc = documents.make_document("peer", PeerConfig(), {"rows": rows, "comparison": comparison})
    path = documents.write_result(doc, tmp_path)
    assert peer.plot_peer(path).stat().st_size > 5000


def test_ours_only_run_needs_no_kvpress(tiny_pair, short_prompts, capsys):
    model, tok = tiny_pair
    commands = []

    def in_process(cmd: list[str], what: str, timeout: float) -> dict:
        commands.append(cmd)
        assert peer.worker_main(cmd[cmd.index("--worker") + 1 :]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[-1])

    # the --quick preset without the kvpress side, on the tiny model
    config = dataclasses.replace(
        peer.QUICK,
        budget=48,
        interval=8,
        tokens=16,
        presses=(),
        ours=("streaming", "h2o"),
        prompt_source=str(short_prompts),
        prompt_index=0,
        chat=False,
    )
    bars = []

    class Recording(documents.Reporter):
        def bar(self, total: int, desc: str, unit: str = "it"):
            bars.append(super().bar(total, desc, unit))
            return bars[-1]

    doc = peer.run_peer(config, model, tok, runner=in_process, reporter=Recording(progress=True))
    assert [(b.desc, b.n, b.total) for b in bars] == [("bench peer", 2, 2)]
    rows = doc["results"]["rows"]
    assert [r["method"] for r in rows] == ["streaming", "h2o"]
    assert rows[0]["kept_set"]["all_match"] is True
    assert ["--attention", "eager"] == commands[1][commands[1].index("--attention") :][:2]
    assert all(r["peak_cache_tokens"] <= 48 + 8 for r in rows)
    assert all("cache_spec" not in r for r in rows)  # the workers' specs went into the config
    described = [s["describe"] for s in doc["config"]["cache_specs"]]
    assert described == ["policy=streaming budget=48 interval=8", "policy=h2o budget=48 interval=8"]
