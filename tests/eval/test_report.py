from __future__ import annotations

import json
from pathlib import Path

import pytest

from epikv.eval.report import find_run_folders, report

from .test_metrics import record


def make_run(out: Path, policy: str, budget: int | None, outcomes: list[tuple[bool, bool, float]]) -> Path:
    """A run folder written by hand: one (correct, cap_hit, seconds) per example."""
    folder = out / "math500" / policy / ("Kfull" if budget is None else f"K{budget}")
    folder.mkdir(parents=True)
    config = {"dataset": "math500", "policy": policy, "budget": budget, "max_new_tokens": 8192}
    (folder / "config.json").write_text(json.dumps(config))
    lines = [
        record(
            f"p{i}",
            correct,
            cap_hit=cap,
            tokens=1000 * (i + 1),
            seconds=seconds,
            mean_cache=None if i % 2 else 500 * (i + 1),  # as if every other record were older
        ).to_json()
        for i, (correct, cap, seconds) in enumerate(outcomes)
    ]
    (folder / "results.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    out = tmp_path / "runs"
    make_run(
        out, "h2o", 512, [(True, False, 2.0), (False, True, 4.0), (False, True, 6.0), (False, False, 8.0)]
    )
    make_run(
        out, "h2o", 1024, [(True, False, 1.0), (True, False, 1.0), (False, True, 1.0), (False, False, 1.0)]
    )
    make_run(
        out, "epikv", 512, [(True, False, 3.0), (True, False, 3.0), (True, False, 3.0), (False, True, 3.0)]
    )
    make_run(out, "epikv", 1024, [(True, False, 1.0)] * 4)
    make_run(out, "full", None, [(True, False, 5.0)] * 3 + [(False, False, 5.0)])
    (out / "notes").mkdir()
    return out


def test_table_has_the_right_numbers(runs: Path) -> None:
    table = report([runs])
    lines = table.splitlines()
    assert lines[0].startswith("| dataset | policy | budget |")
    assert len(lines) == 2 + 5
    # Rows sorted by dataset, policy, then budget with the full cache last.
    assert [line.split("|")[2].strip() + "/" + line.split("|")[3].strip() for line in lines[2:]] == [
        "epikv/512", "epikv/1024", "full/full", "h2o/512", "h2o/1024",
    ]  # fmt: skip
    h2o_512 = lines[5]
    # 1 of 4 correct: Wilson 95% [4.6, 69.9]; 2 of 4 hit the cap; mean tokens 2500; peak cached 2500
    # on average, mean cached (500 + 1500) / 2 over the records that have it; 20 s / 4 problems.
    assert (
        h2o_512 == "| math500 | h2o | 512 | 4 | 25.0 [4.6, 69.9] | 50.0 | 0.0 | 2500 | 2500 / 1000 | 5.00 |"
    )
    epikv_1024 = (
        "| math500 | epikv | 1024 | 4 | 100.0 [51.0, 100.0] | 0.0 | 0.0 | 2500 | 2500 / 1000 | 1.00 |"
    )
    assert lines[3] == epikv_1024


def test_plots_are_drawn_from_files_alone(runs: Path, tmp_path: Path) -> None:
    plots = tmp_path / "plots"
    report([runs / "math500"], plots=plots)
    names = sorted(p.name for p in plots.glob("*.png"))
    assert names == [
        "accuracy_vs_budget_math500.png",
        "accuracy_vs_seconds_math500.png",
        "cap_hit_vs_budget_math500.png",
    ]
    for path in plots.glob("*.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_plots_of_runs_scoring_none_and_all(tmp_path: Path) -> None:
    # Issue #12: a 0% run (0 of 50) and a 100% run (10 of 10) made negative error bars and no plot.
    make_run(tmp_path, "h2o", 512, [(False, False, 1.0)] * 50)
    make_run(tmp_path, "h2o", 1024, [(True, False, 1.0)] * 10)
    table = report([tmp_path], plots=tmp_path / "plots")
    assert "| h2o | 512 | 50 | 0.0 [0.0, 7.1] |" in table
    assert "| h2o | 1024 | 10 | 100.0 [72.2, 100.0] |" in table
    assert len(list((tmp_path / "plots").glob("*.png"))) == 3


def test_report_merges_shards_and_finds_nested_folders(tmp_path: Path) -> None:
    folder = make_run(tmp_path, "h2o", 256, [(True, False, 1.0)])
    (folder / "results.jsonl").rename(folder / "results.shard-0-of-2.jsonl")
    second = record("p1", False).to_json() + "\n" + record("p0", True, tokens=1000).to_json() + "\n"
    (folder / "results.shard-1-of-2.jsonl").write_text(second)
    assert find_run_folders([tmp_path]) == [folder.resolve()]
    assert "| math500 | h2o | 256 | 2 | 50.0 [" in report([tmp_path])


def test_report_without_runs_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no run folders"):
        report([tmp_path])


def test_regrade_uses_current_rules(tmp_path):
    import json

    from epikv.eval.report import report

    folder = tmp_path / "gsm8k" / "full" / "Kfull"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"dataset": "gsm8k", "policy": "full", "budget": None}))
    row = {
        "id": "gsm8k-0000",
        "sample": 0,
        "correct": False,
        "extracted": None,
        "gold": "18",
        "tokens_generated": 10,
        "prompt_tokens": 5,
        "finish_reason": "eos",
        "cap_hit": False,
        "loop": False,
        "loop_onset": None,
        "loop_period": None,
        "seconds": 1.0,
        "call_seconds": 1.0,
        "batch_size": 1,
        "peak_cache_tokens": 15,
        "final_cache_tokens": 15,
        "evictions": 0,
        "text": "The answer is: 18",
    }
    (folder / "results.jsonl").write_text(json.dumps(row) + "\n")
    assert "| 0.0 [" in report([tmp_path])
    assert "| 100.0 [" in report([tmp_path], regrade_text=True)
    # The same last number at the length cap, with no marker: the regrade reads the record's finish.
    cut = {**row, "correct": True, "extracted": "18", "finish_reason": "length", "cap_hit": True,
           "text": "she sells 9 eggs at $2, so 9 x 2 = 18"}  # fmt: skip
    (folder / "results.jsonl").write_text(json.dumps(cut) + "\n")
    assert "| 100.0 [" in report([tmp_path])
    assert "| 0.0 [" in report([tmp_path], regrade_text=True)


def test_full_is_a_reference_line_even_when_filed_under_a_budget(tmp_path: Path) -> None:
    # Issue #12 item 9: older versions filed `--policy full --budget 160` as K160 and drew a point there.
    from epikv.eval.plots import budget_figure
    from epikv.eval.runs import load_runs

    make_run(tmp_path, "h2o", 128, [(True, False, 1.0), (False, False, 1.0)])
    make_run(tmp_path, "h2o", 256, [(True, False, 1.0)] * 2)
    make_run(tmp_path, "full", 160, [(True, False, 1.0)] * 3 + [(False, False, 1.0)])
    assert "| math500 | full | full | 4 | 75.0 [" in report([tmp_path])
    axes = budget_figure(load_runs([tmp_path]), "accuracy", "accuracy (%)", "t").axes[0]
    lines = {line.get_label(): line for line in axes.get_lines()}
    full = lines["full"]
    assert full.get_linestyle() == "--" and list(full.get_xdata()) == [0, 1]  # across the whole axis
    assert list(full.get_ydata()) == [75.0, 75.0]
    points = {x for line in axes.get_lines() if line is not full for x in line.get_xdata()}
    assert points == {128, 256} and [t.get_text() for t in axes.get_xticklabels()] == ["128", "256"]
