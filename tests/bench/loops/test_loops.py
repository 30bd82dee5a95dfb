"""The loop study on a tiny random model: its plan, a resumable and shardable run, the figure and
tables from the file alone, and the command line's one-line errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from epikv.bench.loops import runs as loops_runs
from epikv.bench.loops import study as loops
from epikv.bench.loops.study import LoopsConfig
from epikv.bench.shared import documents
from epikv.cli import main
from tests.helpers.ray_cluster import local_cluster, ray_test


@pytest.fixture(scope="module")
def problems_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("loops") / "tiny.jsonl"
    rows = [
        {"problem": "Ann has 3 apples and buys 2. How many?", "answer": "5"},
        {"problem": "What is 2+2?", "answer": "4"},
        {"problem": "A train runs 60 km/h for 2 h. How far?", "answer": "120"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(problems_file, tmp_path, **changes) -> LoopsConfig:
    base = LoopsConfig(
        model="random:tiny-llama",
        datasets=(str(problems_file),),
        problems=(3,),
        offsets=(0,),
        max_new_tokens=24,
        policies=("full", "streaming", "h2o", "epikv"),
        peaks=(48,),
        sweep_policies=("h2o",),
        sweep_budgets=(40,),
        references=("full", "h2o"),
        loop_min_span=8,
        batch_size=2,
        parts_dir=str(tmp_path / "parts"),
    )
    return dataclasses.replace(base, **changes)


def test_plan_matches_peaks_and_says_why_a_policy_cannot(tiny_pair, problems_file, tmp_path):
    specs, plan = loops.plan_cells(tiny_pair[0], _config(problems_file, tmp_path, peaks=(48, 160)))
    cells = {(e["label"], e["kind"], e["target"]): e.get("cell") for e in plan}
    assert cells[("full", "peak", 48)] == "full" and cells[("h2o", "peak", 48)] == "h2o@47"
    assert cells[("epikv", "peak", 48)] is None  # tau = 128 leaves nothing at a 48-token peak
    assert cells[("epikv", "peak", 160)] == "epikv@32" and cells[("h2o", "sweep", 40)] == "h2o@40"
    assert next(iter(specs)) == "full" and specs["epikv@32"].budget == 32
    why = next(e["why"] for e in plan if e["label"] == "epikv" and e["target"] == 48)
    assert "interval tau = 128" in why
    with pytest.raises(ValueError, match="sweep policy 'full' does not evict"):
        loops.plan_cells(tiny_pair[0], _config(problems_file, tmp_path, sweep_policies=("full",)))


def test_run_is_resumable_cell_by_cell(tiny_pair, problems_file, tmp_path, monkeypatch):
    config = _config(problems_file, tmp_path)
    document = loops.run_loops(config, *tiny_pair)
    results = document["results"]
    assert results["batches"] == {"total": 2, "complete": 2}
    assert [p["id"] for p in results["problems"]] == ["0", "1", "2"]
    assert set(results["problems"][0]["cells"]) == {"full", "streaming@47", "h2o@47", "h2o@40"}
    full = results["problems"][0]["cells"]["full"]
    assert full["divergence"] == full["length"] and not full["diverged"]  # full follows itself
    parts = sorted((tmp_path / "parts").rglob("*.json"))
    assert len(parts) == 2 * 4  # 2 batches x (full + 3 cells)
    stored = json.loads(parts[0].read_text())
    assert "load_average" in stored and "token_ids" in stored["results"][0]
    cost = results["cost"]["h2o@47"]  # what planning a full run needs: seconds, tokens, the load
    assert cost["parts"] == 2 and cost["tokens"] == sum(
        p["cells"]["h2o@47"]["length"] for p in results["problems"]
    )
    assert len(cost["load_average"]) == 2 and cost["tokens_per_second"] > 0

    calls = []
    real = loops.generate_cell

    def counting(*args, **kwargs):
        calls.append((args[3].policy.name, len(args[2])))  # (policy, batches packed in one run)
        return real(*args, **kwargs)

    monkeypatch.setattr(loops, "generate_cell", counting)
    again = loops.run_loops(config, *tiny_pair)
    assert calls == [] and again["results"]["problems"] == results["problems"]  # nothing rerun
    # another loop threshold needs no model: the parts keep the token ids
    looser = loops.run_loops(dataclasses.replace(config, loop_min_span=4), *tiny_pair)
    assert calls == [] and looser["results"]["plan"] == results["plan"]
    # a longer cap is another computation: every part is made again, one engine run per cell
    loops.run_loops(dataclasses.replace(config, max_new_tokens=25), *tiny_pair)
    assert calls == [("full", 2), ("streaming", 2), ("h2o", 2), ("h2o", 2)]
    assert len(list((tmp_path / "parts").rglob("*.json"))) == 2 * 4  # the same parts, replaced


def test_packing_batches_into_one_run_changes_no_token(tiny_pair, problems_file, tmp_path):
    """A cell's batches run as one engine run with ``max_batch`` rows, refilled as problems finish:
    each problem's generation equals the one from a run of it alone (one row at a time)."""
    config = _config(problems_file, tmp_path)
    model, tokenizer = tiny_pair
    problems = loops_runs.load_problems(str(problems_file), 3, 0, tokenizer, config.system_prompt)
    specs, _ = loops.plan_cells(model, config)
    for name in ("full", "h2o@47", "streaming@47"):

        def run(groups, rows, spec=specs[name]):
            out = loops_runs.generate_cell(model, tokenizer, groups, spec, 24, frozenset({5}), rows)
            return [r["token_ids"] for group in out for r in group]

        alone = run([problems], 1)
        assert run([problems], 3) == alone and run([problems[:1], problems[1:]], 2) == alone, name
        assert len({len(t) for t in alone}) > 1, name  # rows leave at different steps (EOS = 5)


def test_each_group_is_reported_once_as_it_completes(tiny_pair, problems_file, tmp_path):
    config = _config(problems_file, tmp_path)
    model, tokenizer = tiny_pair
    problems = loops_runs.load_problems(str(problems_file), 3, 0, tokenizer, config.system_prompt)
    specs, _ = loops.plan_cells(model, config)
    seen = []
    groups = [problems[:1], problems[1:]]
    out = loops_runs.generate_cell(
        model, tokenizer, groups, specs["h2o@47"], 24, frozenset(), 2, lambda g, r, s: seen.append((g, r, s))
    )
    assert sorted(g for g, _, _ in seen) == [0, 1] and all(s >= 0 for _, _, s in seen)
    assert [r for _, r, _ in sorted(seen, key=lambda x: x[0])] == out and len(out[1]) == 2


def test_shards_split_cells_and_a_last_run_assembles(tiny_pair, problems_file, tmp_path, monkeypatch):
    config = _config(problems_file, tmp_path, sweep_policies=(), sweep_budgets=())
    calls = []
    real = loops.generate_cell

    def counting(*args, **kwargs):
        calls.append(args[3].policy.name)
        return real(*args, **kwargs)

    monkeypatch.setattr(loops, "generate_cell", counting)
    first = loops.run_loops(dataclasses.replace(config, shard="1/2"), *tiny_pair)
    assert first["results"]["batches"] == {"total": 2, "complete": 0} and calls == ["streaming"]
    assert first["results"]["problems"] == []  # no batch has every cell yet
    with pytest.raises(ValueError, match="no batch has every cell yet"):  # one line, not an IndexError
        loops.plot_loops(documents.write_result(first, tmp_path / "shard"))
    # a stopped run left batch 0 of full behind: the next shard computes only what is missing
    loops.run_loops(dataclasses.replace(config, shard="0/2", problems=(2,)), *tiny_pair)
    assert calls == ["streaming", "full", "h2o"]
    whole = loops.run_loops(config, *tiny_pair)  # full's and h2o's batch 1 (problem 2), then assembly
    assert whole["results"]["batches"]["complete"] == 2 and calls == [
        "streaming",
        "full",
        "h2o",
        "full",
        "h2o",
    ]


def test_figure_and_tables_come_from_the_file(tiny_pair, problems_file, tmp_path, capsys):
    document = loops.run_loops(_config(problems_file, tmp_path), *tiny_pair)
    path = documents.write_result(document, tmp_path / "out")
    assert loops.plot_loops(path).stat().st_size > 5000
    assert main(["bench", "table", str(path)]) == 0
    table = capsys.readouterr().out
    assert "equal peak memory = 48" in table and "equal K (sweep) = 40" in table
    assert "| epikv | – | cannot match: peak 48 is not above" in table
    assert "Δ loops vs full" in table and "Δ accuracy vs h2o" in table
    name = document["results"]["summary"]["datasets"][0]
    assert main(["bench", "table", str(path), "--datasets", name]) == 0 and name in capsys.readouterr().out
    assert main(["bench", "table", str(path), "--datasets", "nope"]) == 2
    assert "--datasets nope: the result has" in capsys.readouterr().err
    assert main(["bench", "table", str(path), "--genres", name]) == 2  # a loops result has datasets
    assert "a loops result is split by datasets; give --datasets" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policies", "h2o,streaming"], "policies must include 'full'"),
        (["--problems", "2,3"], "need one --problems count per dataset"),
        (["--references", "full,tova"], "references ['tova'] are not among the policies"),
        (["--shard", "2/2"], "shard index must satisfy 0 <= I < N"),
        (["--shard", "0/2", "--ray", "local"], "give --shard I/N"),
    ],
)
def test_cli_errors_are_one_line(flags, message, tmp_path, capsys):
    argv = ["bench", "loops", "--quick", "--model", "random:tiny-llama", "--out", str(tmp_path / "o")]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("epikv: error: ")
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_cli_runs_and_plots(problems_file, tmp_path, capsys):
    argv = ["bench", "loops", "--model", "random:tiny-llama", "--datasets", str(problems_file)]
    argv += ["--problems", "2", "--offsets", "1", "--max-new-tokens", "12", "--policies", "full,streaming"]
    argv += ["--peaks", "40", "--sweep-policies", "", "--sweep-budgets", "", "--references", "full"]
    assert main([*argv, "--no-progress", "--out", str(tmp_path)]) == 0
    data = documents.read_result(tmp_path / "loops.json", "loops")
    assert data["config"]["threads"] == 1 and data["config"]["offsets"] == [1]
    assert data["results"]["summary"]["rows"][str(problems_file)]["streaming@39"]["problems"] == 2
    assert (tmp_path / "loops.png").is_file() and (tmp_path / "loops-parts").is_dir()


@ray_test
def test_ray_shards_write_the_parts_the_driver_assembles(tiny_pair, problems_file, tmp_path):
    config = _config(problems_file, tmp_path, sweep_policies=(), sweep_budgets=(), shards=2)
    with local_cluster(240):
        document = loops.run_loops(dataclasses.replace(config, ray="local"), *tiny_pair)
    assert document["results"]["batches"] == {"total": 2, "complete": 2}
    assert len(list((tmp_path / "parts").rglob("*.json"))) == 2 * 3
