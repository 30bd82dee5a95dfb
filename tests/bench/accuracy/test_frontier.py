"""The frontier study's design (issue 56): its cells hold the peak their level names, the reused
cells are the accuracy study's own folders, the declared extension rule, and the command's refusals."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from epikv.bench.accuracy.design import interval
from epikv.bench.accuracy.frontier import Frontier, FrontierCell
from epikv.eval.plan import plan_run
from epikv.spec import peak_for_budget

ROOT = Path(__file__).resolve().parents[3]


def _peak(cell: FrontierCell) -> int:
    tau = 1 if cell.cell.rank_every is not None else interval(cell.cell.policy)
    assert cell.cell.budget is not None
    return peak_for_budget(cell.cell.budget, tau)


def test_every_cell_holds_at_most_its_levels_peak_and_each_level_has_the_issues_configurations() -> None:
    frontier = Frontier()
    cells = frontier.cells()
    assert all(_peak(c) == c.level for c in cells)
    at_320 = {(c.cell.policy, c.cell.budget, c.cell.rank_every, c.home) for c in cells if c.level == 320}
    assert at_320 == {
        ("streaming-prompt", 319, None, "frontier"), ("random-head", 319, None, "frontier"),
        ("epikv", 319, 32, "frontier"), ("epikv", 319, 128, "frontier"), ("keydiff", 319, 128, "frontier"),
        ("snapkv", 319, 128, "frontier"), ("keydiff", 319, None, "accuracy"),
        ("epikv", 192, None, "accuracy"),
    }  # fmt: skip
    at_193 = {(c.cell.policy, c.cell.rank_every, c.home) for c in cells if c.level == 193}
    assert ("keydiff", None, "accuracy") in at_193 and len(at_193) == 7
    new = [c for c in cells if c.home == "frontier"]
    assert all(c.cell.problems == 256 and c.cell.dataset == "gsm8k:shuffle=0" for c in new)
    assert {c.cell.engine for c in new if c.cell.policy == "snapkv"} == {"epikv"}  # reads attention rows
    assert len({c.name for c in cells}) == len(cells)


def test_reused_cells_are_the_accuracy_studys_committed_folders_and_new_ones_their_own() -> None:
    frontier = Frontier()
    for cell in frontier.cells():
        home = "results/accuracy" if cell.home == "accuracy" else "results/frontier"
        folder = plan_run(cell.cell.config(home, frontier.study.model, frontier.study.dtype, False)).folder
        if cell.home == "accuracy":
            assert (ROOT / folder / "results.jsonl").is_file(), folder
        else:
            assert f"rho{cell.cell.rank_every}" in folder.parts or cell.cell.rank_every is None
            assert not (ROOT / "results/accuracy" / folder.relative_to("results/frontier")).exists()


def test_only_undecided_target_pairs_extend_and_only_their_new_cells() -> None:
    frontier = Frontier()
    keydiff = "gsm8k/keydiff@K319"
    tests = [
        {"a": "gsm8k/epikv@K319 rho=32", "b": keydiff, "p_holm": 0.2},  # undecided: extends
        {"a": keydiff, "b": "gsm8k/epikv@K319 rho=128", "p_holm": 0.01},  # decided
        {"a": "gsm8k/epikv@K192", "b": keydiff, "p_holm": 0.5},  # undecided, but both reused
        {"a": "gsm8k/random-head@K319", "b": keydiff, "p_holm": 0.9},  # not a target pair
    ]
    assert frontier.to_extend(320, tests) == ["gsm8k/epikv@K319 rho=32"]
    assert frontier.to_extend(193, tests) == []
    extended = frontier.extend(frontier.find("gsm8k/epikv@K319 rho=32"))
    assert extended.cell.problems == 512 and extended.cell.rank_every == 32


def test_run_refuses_a_reused_cell_and_an_unknown_one() -> None:
    from epikv.bench.accuracy.frontier_cli import cmd_run

    args = argparse.Namespace(cell=["gsm8k/keydiff@K319"], next=0, limit=None, no_progress=True,
                              out="results/frontier", study="results/accuracy")  # fmt: skip
    with pytest.raises(ValueError, match="accuracy study's cell"):
        cmd_run(args)
    with pytest.raises(ValueError, match="no cell 'gsm8k/h2o@K319 rho=4'"):
        Frontier().find("gsm8k/h2o@K319 rho=4")


def test_summarize_reads_the_reused_cells_beside_full_before_any_new_cell_runs(tmp_path: Path) -> None:
    from epikv.bench.accuracy.frontier_cli import summarize

    args = argparse.Namespace(out=str(tmp_path), study=str(ROOT / "results/accuracy"))
    result = summarize(Frontier(), args)
    peak = result["levels"]["320"]
    assert peak["cells"] == ["gsm8k/keydiff@K319", "gsm8k/epikv@K192"] and peak["n"] > 256
    assert set(peak["accuracy"]) == {"gsm8k/full@full", *peak["cells"]}
    assert peak["target_pairs"] == [
        ("gsm8k/epikv@K319 rho=32", "gsm8k/keydiff@K319"),
        ("gsm8k/epikv@K319 rho=128", "gsm8k/keydiff@K319"),
        ("gsm8k/epikv@K192", "gsm8k/keydiff@K319"),
    ]
    assert peak["extend"] == [] and peak["costs"]["gsm8k/epikv@K319 rho=32"]["done"] == 0
